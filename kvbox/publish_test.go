package kvbox

import (
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/statedir"
)

// fakeHolder starts a process whose command line is a port holder's of box
// name (holderAlive takes it for one).
func fakeHolder(t *testing.T, name string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sh", "-c", "sleep 60", "port-forward", "--listen-fds", name)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for i := 0; i < 200 && !strings.Contains(strings.Join(cmdline(cmd.Process.Pid), " "), name); i++ {
		time.Sleep(10 * time.Millisecond)
	}
	return cmd
}

func writeRecord(t *testing.T, path string, r publishRecord) {
	t.Helper()
	b, _ := json.Marshal(r)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// within runs f and fails the test if it has not returned after a long
// while: a read that waits on a FIFO never would.
func within(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s hangs", what)
	}
}

// The box folder is QEMU's to write: what kvbox knows of a box's published
// ports is not read from there. A FIFO planted as publish.json would hang
// ls --json, rm, stop and every command's TTL sweep; a link would be
// followed; and start would bind whatever ports the file lists.
func TestPublishRecordNotInBoxFolder(t *testing.T) {
	state := t.TempDir()
	a := &Host{layout: statedir.Layout{Root: state}}
	b := domain.Box{Name: "web", UUID: "uuid-1", Meta: domain.Meta{Dir: filepath.Join(state, "boxes", "web")}}
	if err := os.MkdirAll(b.Dir, 0o750); err != nil {
		t.Fatal(err)
	}
	// What QEMU's user could plant where a record would be in the folder.
	planted := filepath.Join(b.Dir, "publish.json")

	// A FIFO.
	if err := syscall.Mkfifo(planted, 0o600); err != nil {
		t.Fatal(err)
	}
	within(t, "ls --json's read of a FIFO", func() { a.publishedPorts(b) })
	within(t, "stop's read of a FIFO", func() { a.stopPublish(b) })
	within(t, "start's read of a FIFO", func() { a.republish(b) })
	os.Remove(planted)

	// Ports planted in the folder: start binds nothing and starts nothing.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	writeRecord(t, planted, publishRecord{UUID: b.UUID, Ports: []Port{{Addr: "127.0.0.1", HostPort: port, GuestPort: 22}}})
	if ports, err := a.republish(b); err != nil || ports != nil {
		t.Errorf("start with ports planted in the box folder: %v, %v (want nothing done)", err, ports)
	}
	if got := a.publishedPorts(b); got != nil {
		t.Errorf("ls lists ports planted in the box folder: %v", got)
	}

	// A link planted in the record's place is not followed: the holder
	// it names lives on.
	target := filepath.Join(t.TempDir(), "elsewhere.json")
	h := fakeHolder(t, b.Name)
	writeRecord(t, target, publishRecord{UUID: b.UUID, PID: h.Process.Pid})
	os.Remove(planted)
	if err := os.Symlink(target, planted); err != nil {
		t.Fatal(err)
	}
	if err := a.stopPublish(b); err != nil {
		t.Fatal(err)
	}
	if !holderAlive(h.Process.Pid, b.Name) {
		t.Error("stop followed a link planted in the box folder and ended the process its target names")
	}
	// Nor is a record there as a plain file.
	os.Remove(planted)
	writeRecord(t, planted, publishRecord{UUID: b.UUID, PID: h.Process.Pid})
	if err := a.stopPublish(b); err != nil {
		t.Fatal(err)
	}
	if !holderAlive(h.Process.Pid, b.Name) {
		t.Error("stop ended the process a record planted in the box folder names")
	}

	// kvbox's own record: root's, under the state dir, for this box only.
	h2 := fakeHolder(t, b.Name)
	spec := Port{Addr: "127.0.0.1", HostPort: port, GuestPort: 80}
	writeRecord(t, a.layout.Publish(b.Name, ".json"), publishRecord{UUID: b.UUID, PID: h2.Process.Pid, Ports: []Port{spec}})
	if got := a.publishedPorts(b); len(got) != 1 || got[0] != spec {
		t.Errorf("published ports %v, want %v", got, spec)
	}
	other := b
	other.UUID = "uuid-2" // a new box of the same name
	if got := a.publishedPorts(other); got != nil {
		t.Errorf("a new box of the name has the old one's ports: %v", got)
	}
	if err := a.stopPublish(other); err != nil || !holderAlive(h2.Process.Pid, b.Name) {
		t.Errorf("stop of a new box of the name ended the old one's holder: %v", err)
	}
	if err := a.stopPublish(b); err != nil || holderAlive(h2.Process.Pid, b.Name) {
		t.Errorf("stop did not end the box's holder: %v", err)
	}
	a.forgetPublish(b.Name)
	if _, err := os.Stat(a.layout.Publish(b.Name, ".json")); !os.IsNotExist(err) {
		t.Errorf("the record outlives the box: %v", err)
	}
}

// holderAlive only takes a live process whose arguments are a port holder's
// for that box: a reused pid of anything else is not one.
func TestHolderAlive(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sleep 30", "port-forward", "--listen-fds", "box1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	// Start returns once the child is forked; its command line is the
	// test's own until it has exec'd sh.
	for i := 0; i < 200 && !strings.Contains(strings.Join(cmdline(pid), " "), "box1"); i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if !holderAlive(pid, "box1") {
		t.Error("a live holder of box1 not recognised")
	}
	if holderAlive(pid, "box2") || holderAlive(os.Getpid(), "box1") || holderAlive(0, "box1") {
		t.Error("another process taken for a holder")
	}
	cmd.Process.Kill()
	cmd.Wait()
	if holderAlive(pid, "box1") {
		t.Error("a reaped holder is still alive")
	}
}
