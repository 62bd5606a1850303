package kvbox

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"

	"kvbox.dev/kvbox/base"
)

// A box's console log is read as it is; a link QEMU's user planted in its
// place is refused, not followed.
func TestConsoleLog(t *testing.T) {
	k, d := testDriverHost(t)
	name := "kvbox-unit-console"
	t.Cleanup(func() {
		if dom, err := d.Conn().LookupDomainByName(name); err == nil {
			dom.Undefine()
			dom.Free()
		}
	})
	defineTestBox(t, d, name, nil)
	dir := d.Layout().Box(name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(dir, "console.log")
	os.WriteFile(log, []byte("kvbox-init: started\n"), 0o600)
	r, err := k.ConsoleLog(name)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(r)
	r.Close()
	if string(b) != "kvbox-init: started\n" {
		t.Errorf("console log %q", b)
	}
	secret := filepath.Join(t.TempDir(), "secret")
	os.WriteFile(secret, []byte("root's"), 0o600)
	os.Remove(log)
	if err := os.Symlink(secret, log); err != nil {
		t.Fatal(err)
	}
	if r, err := k.ConsoleLog(name); err == nil {
		b, _ := io.ReadAll(r)
		r.Close()
		t.Errorf("a link in the box folder was followed: read %q", b)
	}
	if _, err := k.ConsoleLog("kvbox-unit-none"); KindOf(err) != base.NotFound {
		t.Errorf("console log of a missing box: %v, want NotFound", err)
	}
}

// The host's facts come from libvirt.
func TestHostFacts(t *testing.T) {
	k, _ := testDriverHost(t)
	ctx := context.Background()
	if err := k.Healthy(ctx); err != nil {
		t.Errorf("Healthy: %v", err)
	}
	cpus, mem, err := k.Capacity(ctx)
	if err != nil || cpus < 1 || mem < 1<<20 {
		t.Errorf("Capacity: %d CPUs, %d bytes, %v", cpus, mem, err)
	}
}
