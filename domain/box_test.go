package domain

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/egress"
)

// testHosts are two hosts with state dirs of their own on one libvirt
// (libvirt's test driver, a private in-process hypervisor).
func testHosts(t *testing.T) (*Host, *Host) {
	t.Helper()
	var hs []*Host
	for range 2 {
		c, err := libvirt.NewConnect("test:///default")
		if err != nil {
			t.Skipf("libvirt's test driver: %v", err)
		}
		h := &Host{StateDir: t.TempDir()}
		h.SetConn(c)
		t.Cleanup(func() { h.Close() })
		hs = append(hs, h)
	}
	return hs[0], hs[1]
}

// defineTestBox defines a stopped box of h called name.
func defineTestBox(t *testing.T, h *Host, name string) {
	t.Helper()
	md, err := MarshalMeta(Meta{Dir: filepath.Join(h.Layout().Boxes(), name), Created: time.Now().UTC(), Transport: "virtio-serial"})
	if err != nil {
		t.Fatal(err)
	}
	x := fmt.Sprintf(`<domain type='test'><name>%s</name><memory unit='KiB'>65536</memory><vcpu>1</vcpu>
<os><type>hvm</type></os><metadata>%s</metadata></domain>`, name, md)
	if err := h.Define(x); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if d, err := h.Conn().LookupDomainByName(name); err == nil {
			d.Undefine()
			d.Free()
		}
	})
}

// Two state dirs on one libvirt do not see or touch each other's boxes.
func TestStateDirsApart(t *testing.T) {
	a, b := testHosts(t)
	defineTestBox(t, a, "apart-a")
	defineTestBox(t, b, "apart-b")
	for _, tc := range []struct {
		h          *Host
		mine, not_ string
	}{{a, "apart-a", "apart-b"}, {b, "apart-b", "apart-a"}} {
		boxes, err := tc.h.Boxes()
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, x := range boxes {
			names = append(names, x.Name)
		}
		if fmt.Sprint(names) != "["+tc.mine+"]" {
			t.Errorf("state dir of %s lists %v", tc.mine, names)
		}
		if _, err := tc.h.Get(tc.not_); !errors.Is(err, base.ErrNotFound) {
			t.Errorf("state dir of %s gets %s: %v", tc.mine, tc.not_, err)
		}
		if err := tc.h.Remove(context.Background(), tc.not_, true); !errors.Is(err, base.ErrNotFound) {
			t.Errorf("state dir of %s removes %s: %v", tc.mine, tc.not_, err)
		}
		if _, err := tc.h.Get(tc.mine); err != nil {
			t.Errorf("state dir of %s: %v", tc.mine, err)
		}
	}
	all, err := a.AllBoxes()
	if err != nil || len(all) < 2 {
		t.Errorf("all boxes: %d, %v", len(all), err)
	}
	// A name is the libvirt host's: another state dir's box has it.
	if err := a.NameFree("apart-b"); !errors.Is(err, base.ErrExists) {
		t.Errorf("a name another state dir's box has is free: %v", err)
	}
}

func TestMetaEgressRoundTrip(t *testing.T) {
	p, err := egress.Spec{Mode: egress.DenyAll, Allow: []string{"api.example.com", "*.github.com"}}.Policy()
	if err != nil {
		t.Fatal(err)
	}
	md, err := MarshalMeta(Meta{IP: "172.30.0.2", Egress: &p})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(md, "<egress>") || !strings.Contains(md, "<allow>*.github.com</allow>") || !strings.Contains(md, "<deny>0.0.0.0/0</deny>") {
		t.Fatalf("metadata without the policy:\n%s", md)
	}
	m, ok, err := MetaOfXML("<domain><metadata>" + md + "</metadata></domain>")
	if err != nil || !ok || m.Egress == nil || !slices.Equal(m.Egress.Allow, p.Allow) || !slices.Equal(m.Egress.Deny, p.Deny) {
		t.Fatalf("read back %+v %v %v", m.Egress, ok, err)
	}
	none, _ := MarshalMeta(Meta{IP: "172.30.0.2"})
	if strings.Contains(none, "egress") {
		t.Errorf("a box without a policy has <egress>:\n%s", none)
	}
}
