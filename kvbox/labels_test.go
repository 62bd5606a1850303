package kvbox

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// A box's labels are root's alone, listed with that box only (not with a
// later box of its name), and go with it.
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
	defineTestBox(t, d, name, nil)
	b, err := d.Get(name)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"e2b.sandbox": "sb-1", "env.TOKEN": "secret"}
	if err := k.setLabels(b, want); err != nil {
		t.Fatal(err)
	}
	got, err := k.Box(ctx, name)
	if err != nil || !reflect.DeepEqual(got.Labels, want) {
		t.Fatalf("labels %v, %v; want %v", got.Labels, err, want)
	}
	path := k.layout.Labels(name)
	for p, mode := range map[string]os.FileMode{path: 0o600, filepath.Dir(path): 0o700 | os.ModeDir} {
		if fi, err := os.Stat(p); err != nil || fi.Mode() != mode {
			t.Errorf("%s: %v, %v; want mode %v", p, fi.Mode(), err, mode)
		}
	}
	if err := k.setLabels(b, map[string]string{"": "x"}); err == nil {
		t.Error("a label without a name was kept")
	}

	// A new box of the name does not get the old one's labels.
	undefineTestBox(t, d, name)
	defineTestBox(t, d, name, nil)
	if got, err := k.Box(ctx, name); err != nil || got.Labels != nil {
		t.Errorf("a new box of the name lists the old one's labels: %v, %v", got.Labels, err)
	}

	// Remove takes them with the box.
	b, _ = d.Get(name)
	if err := k.setLabels(b, want); err != nil {
		t.Fatal(err)
	}
	if err := k.Remove(ctx, name, true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("the labels outlive the box: %v", err)
	}
}
