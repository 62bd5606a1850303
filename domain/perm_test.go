package domain

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/statedir"
)

// Lock files are root's only (a user who can open one can flock it and block
// every kvbox command), an old 0644 one is tightened, and a link planted in
// its place is refused.
func TestLockFileModes(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "lock")
	l, err := base.Lock(path, false)
	if err != nil {
		t.Fatal(err)
	}
	l.Unlock()
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
		t.Fatalf("new lock file is %v, want 0600", st.Mode().Perm())
	}
	os.Chmod(path, 0o644)
	l, err = base.Lock(path, false)
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
	if l, err := base.Lock(link, false); err == nil {
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
	if _, err := os.Stat(h.Layout().FailedConsoleLog("linked")); !os.IsNotExist(err) {
		t.Fatalf("a console.log link was followed and copied (stat: %v)", err)
	}

	fifo := filepath.Join(state, "boxdir-fifo")
	os.MkdirAll(fifo, 0o755)
	if err := syscall.Mkfifo(filepath.Join(fifo, "console.log"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.keepConsoleLog("fifo", fifo) // must not block
	if _, err := os.Stat(h.Layout().FailedConsoleLog("fifo")); !os.IsNotExist(err) {
		t.Fatalf("a console.log FIFO was copied (stat: %v)", err)
	}

	real := filepath.Join(state, "boxdir-real")
	os.MkdirAll(real, 0o755)
	os.WriteFile(filepath.Join(real, "console.log"), []byte("boot failed\n"), 0o644)
	h.keepConsoleLog("real", real)
	st, err := os.Stat(h.Layout().FailedConsoleLog("real"))
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

// plant fills dir with what QEMU's user could put in a box folder in place
// of a file kvbox opens: a link to a host file, a FIFO, a hard link to a
// host file, a folder. It returns the names and the host file.
func plant(t *testing.T, dir string) ([]string, string) {
	t.Helper()
	outside := filepath.Join(t.TempDir(), "shadow")
	if err := os.WriteFile(outside, []byte("root:secret"), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(outside, 0o644)
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Symlink(outside, filepath.Join(dir, "link")))
	must(syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644))
	must(os.Link(outside, filepath.Join(dir, "hardlink")))
	must(os.Mkdir(filepath.Join(dir, "folder"), 0o755))
	return []string{"link", "fifo", "hardlink", "folder"}, outside
}

func assertUntouched(t *testing.T, outside string) {
	t.Helper()
	b, err := os.ReadFile(outside)
	fi, _ := os.Stat(outside)
	if err != nil || string(b) != "root:secret" || fi.Mode().Perm() != 0o644 || fi.Sys().(*syscall.Stat_t).Gid != 0 {
		t.Fatalf("the host file was changed through a planted name: %q %v %v", b, fi.Mode(), err)
	}
}

// Every path kvbox, as root, opens in a folder QEMU's user can write
// refuses what that user could plant there: what it opens there
// (OpenNoFollow) and what it hands to QEMU's group.
func TestPlantedNamesRefused(t *testing.T) {
	h := &Host{facts: &hostFacts{uid: 64055, gid: 64055}}
	for _, tc := range []struct {
		what  string
		do    func(path string) error
		names []string // what it must refuse; all that plant makes when nil
	}{
		{"OpenNoFollow", func(p string) error {
			f, err := OpenNoFollow(p, os.O_RDONLY)
			if err == nil {
				f.Close()
			}
			return err
		}, nil},
		// chown and chmod of a FIFO, a folder or a hard link (the kernel's
		// protected_hardlinks stops QEMU's user making one to a file not
		// its own) reach nothing outside: a link is what it must refuse.
		{"ShareWithQEMU", func(p string) error { return h.ShareWithQEMU(p, statedir.SharedFileMode) }, []string{"link"}},
	} {
		t.Run(tc.what, func(t *testing.T) {
			dir := t.TempDir()
			names, outside := plant(t, dir)
			if tc.names != nil {
				names = tc.names
			}
			for _, n := range names {
				if err := tc.do(filepath.Join(dir, n)); err == nil {
					t.Errorf("%s went through a planted %s", tc.what, n)
				}
			}
			assertUntouched(t, outside)
		})
	}
}

// The real thing passes: a plain file is shared with QEMU's group.
func TestFileShared(t *testing.T) {
	h := &Host{facts: &hostFacts{uid: 64055, gid: 64055}}
	f := filepath.Join(t.TempDir(), "base.qcow2")
	os.WriteFile(f, []byte("x"), 0o600)
	if err := h.ShareWithQEMU(f, statedir.SharedFileMode); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	syscall.Stat(f, &st)
	if st.Uid != 0 || st.Gid != 64055 || st.Mode&0o777 != 0o440 {
		t.Errorf("shared file: %d:%d %o, want 0:64055 440", st.Uid, st.Gid, st.Mode&0o777)
	}
}

// A sealed folder made before its parent was setgid (root:root) gets
// QEMU's group, its files 0440 and itself 0750; one already QEMU's group is
// left as it is.
func TestShareSealed(t *testing.T) {
	h := &Host{facts: &hostFacts{uid: 64055, gid: 64055}}
	dir := filepath.Join(t.TempDir(), "tiny")
	version := filepath.Join(dir, "v-1")
	if err := os.MkdirAll(version, 0o750); err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(version, "disk.qcow2")
	os.WriteFile(disk, []byte("x"), 0o440)
	os.Chown(dir, 0, 0)
	os.Chown(version, 0, 0)
	os.Chown(disk, 0, 0)
	h.shareSealed(dir)
	for p, mode := range map[string]uint32{dir: 0o750, version: 0o750, disk: 0o440} {
		var st syscall.Stat_t
		syscall.Stat(p, &st)
		if st.Uid != 0 || st.Gid != 64055 || st.Mode&0o777 != mode {
			t.Errorf("%s: %d:%d %o, want 0:64055 %o", p, st.Uid, st.Gid, st.Mode&0o777, mode)
		}
	}
	// Already QEMU's group: not touched (its mode stays what it is).
	os.Chmod(disk, 0o400)
	h.shareSealed(dir)
	if fi, _ := os.Stat(disk); fi.Mode().Perm() != 0o400 {
		t.Errorf("a file already QEMU's group was changed to %v", fi.Mode().Perm())
	}
}
