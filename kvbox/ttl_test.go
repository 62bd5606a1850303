package kvbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/snapshot"
)

// testDriverHost is a Host on libvirt's built-in test driver (a private,
// in-process hypervisor: nothing of the machine is touched) with a state
// dir of its own and no reapers.
func testDriverHost(t *testing.T) (*Host, *domain.Host) {
	t.Helper()
	conn, err := libvirt.NewConnect("test:///default")
	if err != nil {
		t.Skipf("libvirt's test driver: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	dir := t.TempDir()
	d := &domain.Host{StateDir: dir}
	d.SetConn(conn)
	l := d.Layout()
	return &Host{cfg: Config{StateDir: dir, NoSweep: true}, d: d, layout: l,
		snaps: snapshot.Store{Dir: l.Snapshots()}, images: image.Store{Dir: l.Images()}}, d
}

// defineTestBox defines a stopped box called name on the test driver
// with deadline at (nil: none) and returns its UUID.
func defineTestBox(t *testing.T, h *domain.Host, name string, at *time.Time) string {
	t.Helper()
	md, err := domain.MarshalMeta(domain.Meta{Dir: h.Layout().Box(name), Created: time.Now().UTC(), Expires: at, Transport: "virtio-serial"})
	if err != nil {
		t.Fatal(err)
	}
	x := fmt.Sprintf(`<domain type='test'><name>%s</name><memory unit='KiB'>65536</memory><vcpu>1</vcpu>
<os><type>hvm</type></os><metadata>%s</metadata></domain>`, name, md)
	d, err := h.Conn().DomainDefineXML(x)
	if err != nil {
		t.Fatalf("define %s: %v", name, err)
	}
	defer d.Free()
	uuid, err := d.GetUUIDString()
	if err != nil {
		t.Fatal(err)
	}
	return uuid
}

func undefineTestBox(t *testing.T, h *domain.Host, name string) {
	t.Helper()
	d, err := h.Conn().LookupDomainByName(name)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free()
	if err := d.Undefine(); err != nil {
		t.Fatal(err)
	}
}

// A TTL removes the box that expired, not a box that took its name since
// (the reaper and the sweep read the deadline, then remove by name: a box
// made in between went in the old one's place).
func TestTTLRemovesByIdentity(t *testing.T) {
	a, h := testDriverHost(t)
	ctx := context.Background()
	past := time.Now().Add(-time.Minute)
	logf := func(format string, v ...any) { t.Logf(format, v...) }
	name := "kvbox-unit-ttl-reused"
	t.Cleanup(func() {
		if d, err := h.Conn().LookupDomainByName(name); err == nil {
			d.Undefine()
			d.Free()
		}
	})

	// The expired box, then a new box of the same name (with no TTL, and
	// one whose own TTL has passed too).
	for _, newAt := range []*time.Time{nil, &past} {
		old := defineTestBox(t, h, name, &past)
		undefineTestBox(t, h, name)
		reused := defineTestBox(t, h, name, newAt)
		if err := a.reap(ctx, ReapBox, name, old, logf); err != nil {
			t.Errorf("reaper of the old box: %v", err)
		}
		if b, err := h.Get(name); err != nil || b.UUID != reused {
			t.Fatalf("the old box's reaper removed the new box of its name (deadline %v): %v", newAt, err)
		}
		// The sweep's removal of a box it listed as expired.
		err := a.removeIf(ctx, name, true, dueBox(old))
		if !errors.Is(err, base.ErrNotDue) {
			t.Errorf("the sweep's removal of the old box: %v, want ErrNotDue", err)
		}
		if b, err := h.Get(name); err != nil || b.UUID != reused {
			t.Fatalf("the sweep removed the new box of the old one's name (deadline %v): %v", newAt, err)
		}
		undefineTestBox(t, h, name)
	}

	// The box that expired is removed, and one whose deadline was moved
	// on meanwhile is not.
	uuid := defineTestBox(t, h, name, &past)
	if err := a.reap(ctx, ReapBox, name, uuid, logf); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Get(name); !errors.Is(err, base.ErrNotFound) {
		t.Errorf("the expired box is still there: %v", err)
	}
	later := time.Now().Add(time.Hour)
	uuid = defineTestBox(t, h, name, &later)
	if err := a.removeIf(ctx, name, true, dueBox(uuid)); !errors.Is(err, base.ErrNotDue) {
		t.Errorf("removal of a box whose deadline is ahead: %v, want ErrNotDue", err)
	}
	if _, err := h.Get(name); err != nil {
		t.Errorf("a box whose deadline is ahead was removed: %v", err)
	}
}

// The same for snapshots: the reaper of an expired snapshot leaves a
// snapshot made since under its name, even an expired one.
func TestSnapshotTTLRemovesByIdentity(t *testing.T) {
	a, _ := testDriverHost(t)
	ctx := context.Background()
	past := time.Now().Add(-time.Minute).UTC().Truncate(time.Second)
	st := a.snaps
	write := func(created time.Time) snapshot.Snapshot {
		s := snapshot.Snapshot{Name: "nightly", Created: created, Expires: &past}
		dir := filepath.Join(st.Dir, s.Name)
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(s)
		if err := os.WriteFile(filepath.Join(dir, snapshot.MetaFile), b, 0o640); err != nil {
			t.Fatal(err)
		}
		return s
	}
	old := write(time.Now().Add(-2 * time.Hour).UTC())
	reused := write(time.Now().Add(-time.Hour).UTC()) // removed and made again
	logf := func(format string, v ...any) { t.Logf(format, v...) }
	if err := a.reap(ctx, ReapSnapshot, "nightly", snapshotID(old), logf); err != nil {
		t.Fatal(err)
	}
	s, err := st.Get("nightly")
	if err != nil || snapshotID(s) != snapshotID(reused) {
		t.Fatalf("the old snapshot's reaper removed the new snapshot of its name: %v", err)
	}
	if err := a.reap(ctx, ReapSnapshot, "nightly", snapshotID(reused), logf); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Get("nightly"); !errors.Is(err, base.ErrNotFound) {
		t.Errorf("the expired snapshot is still there: %v", err)
	}
}

// A box whose deadline suspends it (a sandbox with onTimeout pause) is
// never removed by its reaper or the sweep: its reaper suspends it, and
// one that cannot be suspended (here a stopped box; the test driver runs
// no QEMU) stays as it is.
func TestTTLSuspendsNeverRemoves(t *testing.T) {
	a, h := testDriverHost(t)
	ctx := context.Background()
	name := "kvbox-unit-ttl-suspend"
	t.Cleanup(func() {
		if d, err := h.Conn().LookupDomainByName(name); err == nil {
			d.Undefine()
			d.Free()
		}
	})
	past := time.Now().Add(-time.Minute).UTC().Truncate(time.Second)
	md, err := domain.MarshalMeta(domain.Meta{Dir: h.Layout().Box(name), Created: time.Now().UTC(), Expires: &past,
		OnExpiry: domain.ExpirySuspend, Transport: "virtio-serial"})
	if err != nil {
		t.Fatal(err)
	}
	d, err := h.Conn().DomainDefineXML(`<domain type='test'><name>` + name + `</name><memory unit='KiB'>65536</memory><vcpu>1</vcpu>
<os><type>hvm</type></os><metadata>` + md + `</metadata></domain>`)
	if err != nil {
		t.Fatal(err)
	}
	uuid, _ := d.GetUUIDString()
	d.Free()
	logf := func(format string, v ...any) { t.Logf(format, v...) }
	if err := a.reap(ctx, ReapBox, name, uuid, logf); base.KindOf(err) != base.Busy {
		t.Errorf("reaper of a stopped box whose deadline suspends it: %v, want Busy (only a running box is suspended)", err)
	}
	a.Sweep(ctx)
	b, err := h.Get(name)
	if err != nil {
		t.Fatalf("a box whose deadline suspends it was removed: %v", err)
	}
	if b.Expires == nil || b.OnExpiry != domain.ExpirySuspend {
		t.Errorf("the box lost its deadline (%v) or what it does (%q) without being suspended", b.Expires, b.OnExpiry)
	}
}

// A reaper started for a box another kvbox has just removed (a sweep that
// listed it before) makes nothing in the box's folder: its log is beside
// the other logs, the folder is not made again, and the reaper finds no
// box to reap.
func TestReaperOfARemovedBoxMakesNoFolder(t *testing.T) {
	a, h := testDriverHost(t)
	ctx := context.Background()
	started := 0
	a.cfg.ReaperCommand = func(kind, name, id string) *exec.Cmd {
		started++
		return exec.Command("true")
	}
	name := "kvbox-unit-reaper-removed"
	t.Cleanup(func() {
		if d, err := h.Conn().LookupDomainByName(name); err == nil {
			d.Undefine()
			d.Free()
		}
	})
	at := time.Now().Add(time.Hour)
	uuid := defineTestBox(t, h, name, &at)
	dir := h.Layout().Box(name)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := a.Remove(ctx, name, true); err != nil {
		t.Fatal(err)
	}
	if err := a.startReaper(ReapBox, name, uuid); err != nil {
		t.Fatal(err)
	}
	if started != 1 {
		t.Fatalf("%d reapers started", started)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the removed box's folder is there again: %v", err)
	}
	if fi, err := os.Lstat(h.Layout().BoxReaperLog(name)); err != nil || !fi.Mode().IsRegular() || filepath.Dir(h.Layout().BoxReaperLog(name)) != h.Layout().Logs() {
		t.Errorf("the reaper's log %s: %v %v", h.Layout().BoxReaperLog(name), fi, err)
	}
}
