package kvbox

import (
	"context"
	"reflect"
	"testing"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/guest-agent/envd"
)

// A box's labels are in its definition: listed with it (and with a later
// box of its name only if that box has them too); a label the domain could
// not keep as given refuses a request before anything is made.
func TestLabels(t *testing.T) {
	k, d := testDriverHost(t)
	ctx := context.Background()
	name := "kvbox-unit-labels"
	t.Cleanup(func() {
		if dom, err := d.Conn().LookupDomainByName(name); err == nil {
			dom.Undefine()
			dom.Free()
		}
	})
	want := map[string]string{"e2b.template": "base", "kubernetes.pod": "default/web-0"}
	defineLabelledBox(t, d, name, domain.Labels(want))
	got, err := k.Box(ctx, name)
	if err != nil || !reflect.DeepEqual(got.Labels, want) {
		t.Fatalf("labels %v, %v; want %v", got.Labels, err, want)
	}
	all, err := k.Boxes(ctx)
	if err != nil || len(all) != 1 || !reflect.DeepEqual(all[0].Labels, want) {
		t.Fatalf("Boxes: %+v, %v; want one box with %v", all, err, want)
	}

	// A new box of the name does not get the old one's labels.
	undefineTestBox(t, d, name)
	defineLabelledBox(t, d, name, nil)
	if got, err := k.Box(ctx, name); err != nil || got.Labels != nil {
		t.Errorf("a new box of the name lists the old one's labels: %v, %v", got.Labels, err)
	}

	// Refused before anything is looked up or made.
	for _, bad := range []map[string]string{{"": "x"}, {"k": "a\x00b"}, {"k\n": "v"}, {"k": "\xff"}} {
		_, _, err := k.Create(ctx, CreateRequest{Name: "kvbox-unit-labels-new", Labels: bad})
		if base.KindOf(err) != base.Invalid {
			t.Errorf("Create with labels %q: %v, want an Invalid error", bad, err)
		}
		_, _, err = k.Clone(ctx, CloneRequest{Name: "kvbox-unit-labels-new", Snapshot: "none", Labels: bad})
		if base.KindOf(err) != base.Invalid {
			t.Errorf("Clone with labels %q: %v, want an Invalid error", bad, err)
		}
	}
}

// defineLabelledBox defines a stopped box called name on the test driver
// with labels in its metadata.
func defineLabelledBox(t *testing.T, h *domain.Host, name string, labels []domain.Label) {
	t.Helper()
	md, err := domain.MarshalMeta(domain.Meta{Dir: h.Layout().Box(name), Created: time.Now().UTC(), Transport: "virtio-serial", Labels: labels})
	if err != nil {
		t.Fatal(err)
	}
	dom, err := h.Conn().DomainDefineXML(`<domain type='test'><name>` + name + `</name><memory unit='KiB'>65536</memory><vcpu>1</vcpu>
<os><type>hvm</type></os><metadata>` + md + `</metadata></domain>`)
	if err != nil {
		t.Fatalf("define %s: %v", name, err)
	}
	dom.Free()
}

// A clone's hostname and envd configuration are checked before its
// snapshot is looked up: nothing is made for a bad one.
func TestCloneRequestChecked(t *testing.T) {
	k, _ := testDriverHost(t)
	ctx := context.Background()
	for _, req := range []CloneRequest{
		{Name: "kvbox-unit-c", Snapshot: "none", Hostname: "web_0"},
		{Name: "kvbox-unit-c", Snapshot: "none", Envd: &envd.Config{EnvVars: map[string]string{"A=B": "x"}}},
	} {
		if _, _, err := k.Clone(ctx, req); base.KindOf(err) != base.Invalid {
			t.Errorf("Clone %+v: %v, want an Invalid error", req, err)
		}
	}
	if _, _, err := k.Clone(ctx, CloneRequest{Name: "kvbox-unit-c", Snapshot: "none", Hostname: "web-0"}); base.KindOf(err) != base.NotFound {
		t.Errorf("Clone of a missing snapshot: %v, want NotFound", err)
	}
}

// SetLabels replaces a box's labels in its definition (read back by Box
// and Boxes), and refuses a label the domain could not keep, leaving the
// old ones.
func TestSetLabels(t *testing.T) {
	k, d := testDriverHost(t)
	ctx := context.Background()
	name := "kvbox-unit-setlabels"
	t.Cleanup(func() {
		if dom, err := d.Conn().LookupDomainByName(name); err == nil {
			dom.Undefine()
			dom.Free()
		}
	})
	defineLabelledBox(t, d, name, domain.Labels(map[string]string{"e2b.template": "base"}))
	want := map[string]string{"e2b.template": "base", "e2b.paused": "filesystem"}
	if b, err := k.SetLabels(ctx, name, want); err != nil || !reflect.DeepEqual(b.Labels, want) {
		t.Fatalf("SetLabels: %v, %v", b.Labels, err)
	}
	if b, err := k.Box(ctx, name); err != nil || !reflect.DeepEqual(b.Labels, want) {
		t.Errorf("read back: %v, %v; want %v", b.Labels, err, want)
	}
	if _, err := k.SetLabels(ctx, name, map[string]string{"bad": "a\x00b"}); base.KindOf(err) != base.Invalid {
		t.Errorf("a label with a NUL: %v, want Invalid", err)
	}
	if b, _ := k.Box(ctx, name); !reflect.DeepEqual(b.Labels, want) {
		t.Errorf("a refused SetLabels changed the labels: %v", b.Labels)
	}
	if _, err := k.SetLabels(ctx, "kvbox-unit-nosuchbox", want); base.KindOf(err) != base.NotFound {
		t.Errorf("no such box: %v, want NotFound", err)
	}
}
