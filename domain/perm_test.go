package domain

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// Lock files are root's only (a user who can open one can flock it and block
// every kvbox command), an old 0644 one is tightened, and a link planted in
// its place is refused.
func TestLockFileModes(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "lock")
	l, err := LockFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	l.Unlock()
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
		t.Fatalf("new lock file is %v, want 0600", st.Mode().Perm())
	}
	os.Chmod(path, 0o644)
	l, err = LockFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	l.Unlock()
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
		t.Fatalf("old 0644 lock file is %v after locking, want 0600", st.Mode().Perm())
	}
	target := filepath.Join(dir, "elsewhere")
	os.WriteFile(target, []byte("x"), 0o644)
	link := filepath.Join(dir, "planted.lock")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if l, err := LockFile(link, false); err == nil {
		l.Unlock()
		t.Fatal("LockFile followed a planted symbolic link")
	}
	if st, _ := os.Stat(target); st.Mode().Perm() != 0o644 {
		t.Fatalf("the link's target was changed to %v", st.Mode().Perm())
	}
}

// A console.log that QEMU's user replaced by a link (to /etc/shadow, say) or
// a FIFO is not copied into logs/; a real one is, readable by root only.
func TestKeepConsoleLogRefusesLinks(t *testing.T) {
	state := t.TempDir()
	h := &Host{StateDir: state}
	secret := filepath.Join(t.TempDir(), "shadow")
	os.WriteFile(secret, []byte("root:secret"), 0o600)

	box := filepath.Join(state, "boxdir-link")
	os.MkdirAll(box, 0o755)
	os.Symlink(secret, filepath.Join(box, "console.log"))
	h.keepConsoleLog("linked", box)
	if _, err := os.Stat(h.FailedConsoleLog("linked")); !os.IsNotExist(err) {
		t.Fatalf("a console.log link was followed and copied (stat: %v)", err)
	}

	fifo := filepath.Join(state, "boxdir-fifo")
	os.MkdirAll(fifo, 0o755)
	if err := syscall.Mkfifo(filepath.Join(fifo, "console.log"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.keepConsoleLog("fifo", fifo) // must not block
	if _, err := os.Stat(h.FailedConsoleLog("fifo")); !os.IsNotExist(err) {
		t.Fatalf("a console.log FIFO was copied (stat: %v)", err)
	}

	real := filepath.Join(state, "boxdir-real")
	os.MkdirAll(real, 0o755)
	os.WriteFile(filepath.Join(real, "console.log"), []byte("boot failed\n"), 0o644)
	h.keepConsoleLog("real", real)
	st, err := os.Stat(h.FailedConsoleLog("real"))
	if err != nil {
		t.Fatalf("a real console log was not kept: %v", err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("kept console log is %v, want 0600", st.Mode().Perm())
	}
}

// closeBoxDir takes world bits off what QEMU made in a box folder and never
// follows a link planted there.
func TestCloseBoxDirRefusesLinks(t *testing.T) {
	dir, outside := t.TempDir(), filepath.Join(t.TempDir(), "host-file")
	os.WriteFile(outside, []byte("x"), 0o644)
	os.Chmod(outside, 0o644)
	mem := filepath.Join(dir, "memory")
	os.WriteFile(mem, []byte("ram"), 0o644)
	os.Chmod(mem, 0o644)
	if err := os.Symlink(outside, filepath.Join(dir, "console.log")); err != nil {
		t.Fatal(err)
	}
	closeBoxDir(dir)
	if fi, _ := os.Stat(mem); fi.Mode().Perm() != 0o640 {
		t.Errorf("memory is %v, want 0640", fi.Mode())
	}
	if fi, _ := os.Stat(outside); fi.Mode().Perm() != 0o644 {
		t.Errorf("the link's target became %v: closeBoxDir followed a planted link", fi.Mode())
	}
}
