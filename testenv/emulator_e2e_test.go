//go:build e2e

package testenv

import (
	"path/filepath"
	"strings"
	"testing"
)

// TestRAMFirstOnTCG: on a TCG host without a MAC security driver, a box and
// its clone run QEMU through kvbox's emulator wrapper, so kvbox's RAM is
// QEMU's first RAM block and libvirt's unused one is gone
// (domain/emulator.go); their snapshots are then copied live
// (TestSnapshotKeepsEveryWrite checks that they lose no write).
func TestRAMFirstOnTCG(t *testing.T) {
	src := name(t, "rf")
	newBox(t, src)
	var r struct {
		Return struct {
			Enabled bool `json:"enabled"`
		} `json:"return"`
	}
	qmpJSON(t, src, `{"execute":"query-kvm"}`, &r)
	if r.Return.Enabled {
		t.Skip("KVM host: kvbox's RAM needs no particular place there, and boxes name QEMU itself")
	}
	caps, err := virsh("capabilities")
	if err != nil {
		t.Fatalf("virsh capabilities: %v %s", err, caps)
	}
	if strings.Contains(caps, "<model>apparmor</model>") || strings.Contains(caps, "<model>selinux</model>") {
		t.Skip("libvirt confines QEMU here (AppArmor or SELinux): boxes name QEMU itself and are copied while paused")
	}
	sn, c := name(t, "rfs"), name(t, "rfc")
	newSnapshot(t, src, sn)
	if res := newClone(t, sn, c); res.code != 0 {
		t.Fatalf("clone: %s", res)
	}
	wrapper := filepath.Join(stateDir, "libexec", "qemu-system-x86_64")
	for _, b := range []string{src, c} {
		x, err := virsh("dumpxml", b)
		if err != nil {
			t.Fatalf("dumpxml %s: %v", b, err)
		}
		if !strings.Contains(x, "<emulator>"+wrapper+"</emulator>") {
			t.Errorf("%s does not run kvbox's emulator wrapper %s", b, wrapper)
		}
		if off := ramBlockOffset(t, b, "kvbox.ram"); off != "0x0000000000000000" {
			t.Errorf("%s: kvbox.ram at %q, want QEMU's first RAM block", b, off)
		}
		if off := ramBlockOffset(t, b, "pc.ram"); off != "" {
			t.Errorf("%s: libvirt's pc.ram is still there, at %s", b, off)
		}
		if copiedPaused(t, b) {
			t.Errorf("%s would be copied while paused", b)
		}
	}
}
