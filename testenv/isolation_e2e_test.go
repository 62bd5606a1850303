//go:build e2e

package testenv

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func storeNames(t testing.TB, sub string) string {
	ents, _ := os.ReadDir(filepath.Join(stateDir, sub))
	var names []string
	for _, e := range ents {
		// Other runs share the state dir: boxes are only this run's.
		if sub != "boxes" || strings.HasPrefix(e.Name(), runID) {
			names = append(names, e.Name())
		}
	}
	return strings.Join(names, " ")
}

// Image names that leave the store and a qcow2 whose data lives in a host
// file are refused by the CLI with one line, and nothing changes: not the
// image store, not the boxes, not the file outside.
func TestIsolationImageInputs(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "host-secret")
	evil := filepath.Join(dir, "evil.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-o", "data_file="+secret, evil, "1M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	// After the create, which makes the data file: the host file kvbox must not touch.
	if err := os.WriteFile(secret, []byte("host secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"images", "rm", "../.."}, `".."`},
		{[]string{"images", "rm", ".."}, `".."`},
		{[]string{"images", "rm", "/etc"}, "may only hold"},
		{[]string{"new", "--image", "../../x", name(t, "x")}, `".."`},
		{[]string{"new", "--image", "../images/tiny", name(t, "x")}, `".."`},
		{[]string{"new", "--image", "a/b", name(t, "x")}, "may only hold"},
		{[]string{"images", "import", "../x", evil}, `".."`},
		{[]string{"images", "import", name(t, "evil"), evil}, "external file " + secret},
	} {
		images, boxes := storeNames(t, "images"), storeNames(t, "boxes")
		r := kvbox(t, tc.args...)
		if r.code == 0 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("kvbox %q: want a failure saying %q, got %s", tc.args, tc.want, r)
		}
		if lines := strings.Count(strings.TrimSpace(r.stderr), "\n") + 1; lines != 1 {
			t.Errorf("kvbox %q: %d lines of error, want 1: %q", tc.args, lines, r.stderr)
		}
		if storeNames(t, "images") != images || storeNames(t, "boxes") != boxes {
			t.Errorf("kvbox %q changed the store", tc.args)
		}
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != "host secret" {
		t.Errorf("the host file behind the data file changed: %d bytes, %v", len(b), err)
	}
}

// TestIsolationModesAtRest: after a box, a snapshot of it, a clone of the
// snapshot and their console logs, nothing this run made under the state
// dir has a world bit, the state dir and its shared folders are
// root:QEMU-group without world bits, and a local user who is neither root
// nor QEMU cannot read the snapshot's memory.
func TestIsolationModesAtRest(t *testing.T) {
	srcName, snapName, cl := name(t, "modesrc"), name(t, "modesnap"), name(t, "modecl")
	newBox(t, srcName)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snapName) })
	mustKvbox(t, "snapshots", "new", srcName, snapName)
	if r := newClone(t, snapName, cl); r.code != 0 { // QEMU reads the 0440 root:QEMU-group files
		t.Fatalf("clone of a sealed snapshot: %s", r)
	}
	inBox(t, cl, "echo modes-ok")

	check := func(p string, fi os.FileInfo) {
		if fi.Mode()&os.ModeSymlink == 0 && fi.Mode().Perm()&0o007 != 0 {
			t.Errorf("%s is %v: others may %s it", p, fi.Mode(), map[bool]string{true: "traverse or list", false: "read or write"}[fi.IsDir()])
		}
	}
	walk := func(root string) {
		n := 0
		err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
			if err != nil {
				return err
			}
			n++
			check(p, fi)
			return nil
		})
		if err != nil {
			t.Errorf("walk %s: %v", root, err)
		}
		t.Logf("%s: %d entries checked", root, n)
	}
	for _, sub := range []string{"", "boxes", "snapshots", "images", "locks", "logs"} {
		p := filepath.Join(stateDir, sub)
		if fi, err := os.Lstat(p); err == nil {
			check(p, fi)
		} else if sub == "" || sub == "boxes" || sub == "snapshots" {
			t.Errorf("%s: %v", p, err)
		}
	}
	walk(filepath.Join(stateDir, "boxes", srcName))
	walk(filepath.Join(stateDir, "boxes", cl))
	walk(filepath.Join(stateDir, "snapshots", snapName))
	walk(filepath.Join(stateDir, "images", "tiny"))
	logs, _ := filepath.Glob(filepath.Join(stateDir, "logs", runID+"*"))
	for _, l := range logs {
		walk(l)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "boxes", cl, "console.log")); err != nil {
		t.Errorf("the clone's console log: %v", err)
	}

	// The snapshot's files are root's, group QEMU's, read-only; the token
	// of the agent in its memory is root's only (QEMU needs none of it).
	snapDir := filepath.Join(stateDir, "snapshots", snapName)
	ents, err := os.ReadDir(snapDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		fi, _ := os.Lstat(filepath.Join(snapDir, e.Name()))
		st := fi.Sys().(*syscall.Stat_t)
		want := os.FileMode(0o440)
		if e.Name() == "agent.token" {
			want = 0o400
		}
		if st.Uid != 0 || fi.Mode().Perm() != want {
			t.Errorf("snapshot file %s: uid %d gid %d mode %v, want root-owned %v", e.Name(), st.Uid, st.Gid, fi.Mode(), want)
		}
	}

	// A user who is neither root nor in QEMU's group cannot read the memory.
	mem := filepath.Join(snapDir, "state")
	out, err := exec.Command("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "head", "-c", "16", mem).CombinedOutput()
	if err == nil {
		t.Errorf("user nobody read %s: %q", mem, out)
	} else if !strings.Contains(string(out), "Permission denied") {
		t.Errorf("nobody reading %s failed, but not for permission: %v %s", mem, err, out)
	}
	t.Logf("nobody reading %s: %s", mem, strings.TrimSpace(string(out)))
	// Sanity: the same command as root reads it, so the refusal above is the modes'.
	if out, err := exec.Command("head", "-c", "16", mem).CombinedOutput(); err != nil {
		t.Errorf("root cannot read %s: %v %s", mem, err, out)
	}
}

// TestIsolationSharedFilesStayRoots: while a box and a clone run, the base
// image they build on and the snapshot the clone maps stay root's (libvirt
// relabels nothing: boxes run QEMU under a static DAC label), so QEMU's user
// can read them through its group but neither write them nor chmod them;
// each box's own disk is QEMU's. A fresh copy of the tiny image is used, so
// no other run's box shares it.
func TestIsolationSharedFilesStayRoots(t *testing.T) {
	var tiny struct{ Disk, Kernel, Initrd, Cmdline string }
	b, err := os.ReadFile(filepath.Join(stateDir, "images", "tiny", "image.json"))
	if err != nil || json.Unmarshal(b, &tiny) != nil {
		t.Fatalf("read the tiny image: %v", err)
	}
	img, src, snap, cl := name(t, "rootimg"), name(t, "rootsrc"), name(t, "rootsnap"), name(t, "rootcl")
	t.Cleanup(func() {
		kvbox(t, "rm", "--force", cl, src)
		kvbox(t, "snapshots", "rm", snap)
		kvbox(t, "images", "rm", img)
	})
	mustKvbox(t, "images", "import", img, tiny.Disk, "--kernel", tiny.Kernel, "--initrd", tiny.Initrd, "--cmdline", tiny.Cmdline, "--agent", "yes")
	newBox(t, src, "--image", img)
	mustKvbox(t, "snapshots", "new", src, snap)
	if r := newClone(t, snap, cl); r.code != 0 {
		t.Fatalf("clone: %s", r)
	}
	inBox(t, cl, "echo ok")
	var im struct{ Disk string }
	b, _ = os.ReadFile(filepath.Join(stateDir, "images", img, "image.json"))
	if json.Unmarshal(b, &im) != nil || im.Disk == "" {
		t.Fatalf("image %s has no disk in its image.json", img)
	}
	shared, _ := filepath.Glob(filepath.Join(filepath.Dir(im.Disk), "*"))
	snapFiles, _ := filepath.Glob(filepath.Join(stateDir, "snapshots", snap, "*"))
	shared = append(shared, snapFiles...)
	if len(shared) < 5 {
		t.Fatalf("found only %v", shared)
	}
	qemuUID := ""
	for _, p := range shared {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if st.Uid != 0 || fi.Mode().Perm()&0o222 != 0 {
			t.Errorf("%s: uid %d, mode %v while boxes run on it; want root's and read-only", p, st.Uid, fi.Mode())
		}
		qemuUID = fmt.Sprint(st.Gid) // QEMU's group, and (Debian) its user has the same id
	}
	for _, p := range []string{im.Disk, filepath.Join(stateDir, "snapshots", snap, "disk.qcow2")} {
		as := func(args ...string) (string, error) {
			out, err := exec.Command("setpriv", append([]string{"--reuid=" + qemuUID, "--regid=" + qemuUID, "--clear-groups"}, args...)...).CombinedOutput()
			return string(out), err
		}
		if out, err := as("head", "-c", "1", p); err != nil {
			t.Errorf("QEMU's user cannot read %s: %v %s", p, err, out)
		}
		if out, err := as("dd", "if=/dev/null", "of="+p, "conv=notrunc", "status=none"); err == nil || !strings.Contains(out, "Permission denied") {
			t.Errorf("QEMU's user opening %s for writing: %v %s", p, err, out)
		}
		if out, err := as("chmod", "u+w", p); err == nil || !strings.Contains(out, "not permitted") {
			t.Errorf("QEMU's user chmod of %s: %v %s", p, err, out)
		}
	}
	for _, n := range []string{src, cl} {
		fi, err := os.Stat(filepath.Join(stateDir, "boxes", n, "disk.qcow2"))
		if err != nil || fmt.Sprint(fi.Sys().(*syscall.Stat_t).Uid) != qemuUID {
			t.Errorf("box %s: its own disk is not QEMU's: %v %v", n, fi, err)
		}
	}
	if out, err := virsh("dumpxml", cl); err != nil || !strings.Contains(out, "model='dac' relabel='no'") {
		t.Errorf("the clone's domain has no static DAC label: %v\n%s", err, out)
	}
}

// One box filling the host's filesystem must not kill another: a box's RAM
// is anonymous memory, so the guest touching RAM it never used needs no
// disk (when it was a shared file, QEMU died of SIGBUS in that page fault).
// A box started on the full filesystem runs too, and its guest can touch
// its RAM as well.
func TestIsolationFullDiskKeepsBoxesRunning(t *testing.T) {
	k, fill := smallStateDir(t)
	n, late := name(t, "ramfull"), name(t, "noroom")
	t.Cleanup(func() { k("rm", "--force", n); k("rm", "--force", late) })
	if r := k(append(append([]string{"new"}, smallBox...), n)...); r.code != 0 {
		t.Fatalf("new on the small filesystem: %s", r)
	}
	fill(4 << 20)
	// 80 MB in the guest's tmpfs: RAM the guest had not touched.
	touch := func(box string) {
		t.Helper()
		r := k("exec", box, "--", "sh", "-c", "dd if=/dev/urandom of=/tmp/fill bs=1M count=80 2>/dev/null && sync && md5sum /tmp/fill && rm /tmp/fill && echo alive")
		if r.code != 0 || !strings.HasSuffix(strings.TrimSpace(r.stdout), "alive") {
			t.Fatalf("box %s touching its RAM on a full filesystem: %s", box, r)
		}
		if r := k("exec", box, "--", "true"); r.code != 0 {
			t.Fatalf("exec in %s after filling the disk: %s", box, r)
		}
	}
	touch(n)
	if r := k(append(append([]string{"new"}, smallBox...), late)...); r.code != 0 {
		t.Fatalf("new on the full filesystem (its RAM needs no disk): %s", r)
	}
	touch(late)
	var boxes []struct{ Name, State string }
	st := k("ls", "--json")
	json.Unmarshal([]byte(st.stdout), &boxes)
	running := 0
	for _, b := range boxes {
		if (b.Name == n || b.Name == late) && b.State == "running" {
			running++
		}
	}
	if running != 2 {
		t.Fatalf("boxes after filling the disk: %s", st)
	}
}
