//go:build e2e

package testenv

import (
	"bytes"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Two boxes created at the same moment get distinct addresses and reach each
// other and the namespace's host side.
func TestNewTwoAtOnceAndNetwork(t *testing.T) {
	names := []string{name(t, "a"), name(t, "b")}
	for _, n := range names {
		t.Cleanup(func() { kvbox(t, "rm", "--force", n) })
	}
	results := make([]result, 2)
	parallel(2, func(i int) {
		results[i] = kvbox(t, append(append([]string{"new"}, smallBox...), names[i])...)
	})
	for i, r := range results {
		if r.code != 0 {
			t.Fatalf("kvbox new %s: %s", names[i], r)
		}
		if !strings.Contains(r.stdout, "✓ box "+names[i]+" is running at "+subnetPrefix) || !strings.Contains(r.stdout, "kvbox connect "+names[i]) {
			t.Errorf("kvbox new printed %q", r.stdout)
		}
	}
	a, b := getBox(t, names[0]), getBox(t, names[1])
	if a.IP == "" || a.IP == b.IP || a.MAC == b.MAC {
		t.Fatalf("boxes share an identity: %+v %+v", a, b)
	}
	for _, x := range []box{a, b} {
		if x.State != "running" || x.Image != "tiny" || x.CPUs != 1 || x.MemoryBytes != 256<<20 || x.DiskBytes != 1<<30 {
			t.Errorf("ls --json: %+v", x)
		}
		// The guest has the address, MAC and name kvbox gave it.
		got := inBox(t, x.Name, "hostname; cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0")
		for _, want := range []string{x.Name, x.MAC, x.IP + "/24"} {
			if !strings.Contains(got, want) {
				t.Errorf("box %s: %q lacks %q", x.Name, got, want)
			}
		}
		// The host side of the bridge (in this namespace) reaches the box.
		if out, err := exec.Command("ping", "-c", "1", "-W", "5", x.IP).CombinedOutput(); err != nil {
			t.Errorf("ping %s from the namespace: %v\n%s", x.IP, err, out)
		}
	}
	// Boxes are isolated from each other (netiso_e2e_test.go has the rest).
	inBox(t, a.Name, "! ping -c 1 -W 2 "+b.IP)
}

func TestExec(t *testing.T) {
	n := name(t, "exec")
	newBox(t, n)

	r := kvbox(t, "exec", n, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
	if r.code != 3 || r.stdout != "out\n" || r.stderr != "err\n" {
		t.Errorf("stdout/stderr/exit code: %s", r)
	}
	if r := kvbox(t, "exec", n, "--", "uname", "-s"); r.code != 0 || r.stdout != "Linux\n" {
		t.Errorf("uname: %s", r)
	}
	// A command that reads stdin sees all of it, then EOF.
	in := strings.Repeat("0123456789abcdef\n", 20000) // 340 kB
	if r := kvboxIn(t, in, "exec", n, "--", "sh", "-c", "cat | md5sum"); r.code != 0 || !strings.HasPrefix(r.stdout, md5hex(in)) {
		t.Errorf("stdin through cat | md5sum: %s", r)
	}
	if r := kvbox(t, "exec", n, "--", "/nonexistent"); r.code != 127 || !strings.Contains(r.stderr, "/nonexistent") {
		t.Errorf("a missing program: want exit 127 like a shell, got %s", r)
	}
	// Exit by signal: 128+9.
	if r := kvbox(t, "exec", n, "--", "sh", "-c", "kill -9 $$"); r.code != 137 {
		t.Errorf("killed by SIGKILL: %s", r)
	}
	// Large output comes through whole.
	if r := kvbox(t, "exec", n, "--", "sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x"); r.code != 0 || len(r.stdout) != 3000000 {
		t.Errorf("3 MB of output: got %d bytes, exit %d, stderr %q", len(r.stdout), r.code, r.stderr)
	}
}

func TestConnectPTY(t *testing.T) {
	n := name(t, "pty")
	newBox(t, n)

	ptmx, pts := openPTY(t, 30, 100)
	cmd := exec.Command(kvboxBin, "connect", n)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = pts, pts, pts
	cmd.SysProcAttr = &unix.SysProcAttr{Setsid: true, Setctty: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pts.Close()
	out := &lockedBuffer{}
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := ptmx.Read(buf)
			out.Write(buf[:k])
			if err != nil {
				return
			}
		}
	}()
	send := func(s string) {
		if _, err := ptmx.Write([]byte(s)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor := func(what string) {
		t.Helper()
		eventually(t, 20*time.Second, func() error {
			if strings.Contains(out.String(), what) {
				return nil
			}
			return fmt.Errorf("terminal never showed %q; it shows:\n%s", what, out.String())
		})
	}
	send("echo marker-$((6*7))\r")
	waitFor("marker-42")
	send("tty; stty size\r")
	waitFor("/dev/pts/")
	waitFor("30 100")
	// Resize: the guest sees the new size.
	setWinsize(t, ptmx, 40, 120)
	cmd.Process.Signal(unix.SIGWINCH)
	eventually(t, 10*time.Second, func() error {
		send("stty size\r")
		time.Sleep(300 * time.Millisecond)
		if strings.Contains(out.String(), "40 120") {
			return nil
		}
		return fmt.Errorf("resize not seen")
	})
	// Ctrl-C interrupts the foreground command, not the session.
	send("sleep 100\r")
	time.Sleep(time.Second)
	send("\x03")
	send("echo after-sleep-$?\r")
	waitFor("after-sleep-130")
	send("exit 7\r")
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 7 {
			t.Fatalf("kvbox connect ended with %v, want exit code 7; terminal:\n%s", err, out.String())
		}
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("kvbox connect did not end after exit; terminal:\n%s", out.String())
	}
}

func TestStopStartAndVirsh(t *testing.T) {
	n := name(t, "life")
	b := newBox(t, n)
	inBox(t, n, "echo persisted > /root/file; sync")

	mustKvbox(t, "stop", n)
	if s := getBox(t, n).State; s != "stopped" {
		t.Fatalf("after kvbox stop the box is %s", s)
	}
	if r := kvbox(t, "exec", n, "--", "true"); r.code == 0 {
		t.Errorf("exec in a stopped box succeeded")
	}
	mustKvbox(t, "start", n)
	after := getBox(t, n)
	if after.State != "running" || after.IP != b.IP || after.MAC != b.MAC {
		t.Fatalf("after start: %+v, before %+v", after, b)
	}
	if got := inBox(t, n, "cat /root/file; ip -4 -o addr show dev eth0"); !strings.Contains(got, "persisted") || !strings.Contains(got, b.IP+"/24") {
		t.Errorf("after restart the box shows %q", got)
	}
	// An operator's virsh destroy shows in kvbox ls.
	if out, err := virsh("destroy", n); err != nil {
		t.Fatalf("virsh destroy: %v %s", err, out)
	}
	if s := getBox(t, n).State; s != "stopped" {
		t.Errorf("after virsh destroy kvbox ls says %s", s)
	}
	// And a box shut down by an operator starts again.
	mustKvbox(t, "start", n)
	if out, err := virsh("shutdown", n); err != nil {
		t.Fatalf("virsh shutdown: %v %s", err, out)
	}
	eventually(t, 60*time.Second, func() error {
		if s := getBox(t, n).State; s != "stopped" {
			return fmt.Errorf("after virsh shutdown kvbox ls says %s", s)
		}
		return nil
	})
	if out, _ := virsh("list", "--all", "--name"); !strings.Contains(out, n) {
		t.Errorf("virsh list --all does not show the box: %s", out)
	}
}

func TestRmLeavesNothing(t *testing.T) {
	n := name(t, "rm")
	b := newBox(t, n)
	if r := kvbox(t, "rm", n); r.code == 0 {
		t.Fatalf("rm of a running box without --force succeeded")
	}
	mustKvbox(t, "rm", "--force", n)
	if out, err := virsh("dominfo", n); err == nil {
		t.Errorf("the domain is still there: %s", out)
	}
	if _, err := os.Stat(b.Dir); !os.IsNotExist(err) {
		t.Errorf("the box folder %s is still there: %v", b.Dir, err)
	}
	for _, x := range listBoxes(t) {
		if x.Name == n || x.IP == b.IP {
			t.Errorf("ls still shows the box or its address: %+v", x)
		}
	}
	// The address is free again: the next box in an otherwise unchanged
	// set of boxes gets it back.
	n2 := name(t, "rm2")
	if b2 := newBox(t, n2); b2.IP != b.IP {
		t.Logf("note: the next box got %s, not the freed %s (other boxes may be running)", b2.IP, b.IP)
	}
	if r := kvbox(t, "rm", n); r.code == 0 || !strings.Contains(r.stderr, "does not exist") {
		t.Errorf("rm of a removed box: %s", r)
	}
}

// A failure half-way through new leaves nothing behind.
func TestNewRollsBackWhenAgentIsLate(t *testing.T) {
	n := name(t, "late")
	t.Cleanup(func() { os.Remove(filepath.Join(stateDir, "logs", n+".console.log")) })
	before := boxDirs(t)
	r := kvbox(t, append(append([]string{"new", "--timeout", "1ms"}, smallBox...), n)...)
	if r.code == 0 || !strings.Contains(r.stderr, "did not answer in time") {
		t.Fatalf("new with an impatient agent timeout: %s", r)
	}
	if strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
		t.Errorf("error is more than one line: %q", r.stderr)
	}
	if out, err := virsh("dominfo", n); err == nil {
		t.Errorf("the domain survived the rollback: %s", out)
	}
	if after := boxDirs(t); after != before {
		t.Errorf("box folders before %q, after %q", before, after)
	}
	// Why the guest never answered stays readable after the rollback.
	if _, err := os.Stat(filepath.Join(stateDir, "logs", n+".console.log")); err != nil {
		t.Errorf("the failed box's console log was not kept: %v", err)
	}
}

func boxDirs(t testing.TB) string {
	ents, _ := os.ReadDir(filepath.Join(stateDir, "boxes"))
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return strings.Join(names, " ")
}

func TestBadInput(t *testing.T) {
	existing := name(t, "exists")
	newBox(t, existing)
	long := strings.Repeat("x", 64)
	// Operator templates that cannot make a box.
	tdir := t.TempDir()
	builtin, err := os.ReadFile("../templates/box.xml")
	if err != nil {
		t.Fatal(err)
	}
	tmpl := func(name, body string) string {
		p := filepath.Join(tdir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	noMeta := tmpl("nometa.xml", strings.Replace(string(builtin), "{{.Metadata}}", "", 1))
	noRAM := tmpl("noram.xml", strings.Replace(string(builtin), "<qemu:arg value='{{.}}'/>", "", 1))
	bogus := tmpl("bogus.xml", "<domain type='{{.Type}}'><name>{{.Bogus}}</name></domain>")
	garbage := tmpl("garbage.xml", "not XML {{.Name}}")
	newWith := func(path string) []string {
		return append([]string{"--template", path, "new"}, append(append([]string{}, smallBox...), name(t, "tpl"))...)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"new", "--image", "tiny", ""}, "must not be empty"},
		{[]string{"new", "--image", "tiny", long}, "at most 63"},
		{[]string{"new", "--image", "tiny", "a/b"}, "may only hold"},
		{[]string{"new", "--image", "tiny", "a b"}, "may only hold"},
		{[]string{"new", "--image", "tiny", ".."}, `".."`},
		{[]string{"new", "--image", "tiny", existing}, "already exists"},
		{[]string{"new", "--image", "no-such-image", name(t, "x")}, `image "no-such-image" not found`},
		{[]string{"new", "--image", "tiny", "--memory", "lots", name(t, "x")}, "not a positive size"},
		{[]string{"new", "--image", "tiny", "--memory", "-1G", name(t, "x")}, "not a positive size"},
		{[]string{"new", "--image", "tiny", "--memory", "1M", name(t, "x")}, "at least 64 MB"},
		{[]string{"new", "--image", "tiny", "--disk", "1M", name(t, "x")}, "smaller than image"},
		{[]string{"new", "--image", "tiny", "--cpus", "0", name(t, "x")}, "vCPUs"},
		{[]string{"new"}, "one box name"},
		{[]string{"exec", name(t, "missing"), "--", "true"}, "does not exist"},
		{[]string{"connect", name(t, "missing")}, "does not exist"},
		{[]string{"rm", name(t, "missing")}, "does not exist"},
		{[]string{"rm", existing, name(t, "missing")}, "does not exist"},
		{[]string{"start", name(t, "missing")}, "does not exist"},
		{[]string{"stop", name(t, "missing")}, "does not exist"},
		{[]string{"--connect", "qemu+unix:///system?socket=/nonexistent/sock", "ls"}, "is libvirtd running?"},
		{[]string{"ls", "--bogus"}, "unknown flag"},
		{newWith(filepath.Join(tdir, "missing.xml")), "no such file"},
		{newWith(bogus), "can't evaluate field Bogus"},
		{newWith(garbage), "renders invalid XML"},
		{newWith(noMeta), "drops kvbox's metadata"},
		{newWith(noRAM), "drops the memory backend"},
	} {
		before := boxDirs(t)
		r := kvbox(t, tc.args...)
		if r.code == 0 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("kvbox %q: want a failure saying %q, got %s", tc.args, tc.want, r)
		}
		want := 1
		if tc.args[0] == "rm" && len(tc.args) > 2 {
			want = len(tc.args) // rm of several names: a line per failure, then one summary
		}
		if lines := strings.Count(strings.TrimSpace(r.stderr), "\n") + 1; lines != want {
			t.Errorf("kvbox %q: %d lines of error, want %d: %q", tc.args, lines, want, r.stderr)
		}
		if after := boxDirs(t); after != before {
			t.Errorf("kvbox %q changed the boxes: before %q after %q", tc.args, before, after)
		}
	}
	if s := getBox(t, existing).State; s != "running" {
		t.Errorf("the existing box is %s after the bad commands", s)
	}
}

func openPTY(t testing.TB, rows, cols uint16) (ptmx, pts *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	setWinsize(t, m, rows, cols)
	t.Cleanup(func() { m.Close(); s.Close() })
	return m, s
}

func setWinsize(t testing.TB, f *os.File, rows, cols uint16) {
	if err := unix.IoctlSetWinsize(int(f.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols}); err != nil {
		t.Fatal(err)
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func md5hex(s string) string {
	sum := md5.Sum([]byte(s))
	return hex.EncodeToString(sum[:])
}

// An image without the agent is known as such at import, and new refuses
// it with a message that says how to add the agent.
func TestImageWithoutAgent(t *testing.T) {
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "root/etc"), 0o755)
	disk := filepath.Join(dir, "noagent.raw")
	if out, err := exec.Command("mkfs.ext4", "-q", "-d", filepath.Join(dir, "root"), disk, "32M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v %s", err, out)
	}
	sd := []string{"--state-dir", filepath.Join(dir, "state")}
	if r := kvbox(t, append(sd, "images", "import", "noagent", disk)...); r.code != 0 {
		t.Fatalf("import: %s", r)
	}
	var ims []struct{ Name, Agent string }
	json.Unmarshal([]byte(mustKvbox(t, append(sd, "images", "ls", "--json")...)), &ims)
	if len(ims) != 1 || ims[0].Agent != "no" {
		t.Fatalf("images ls: %+v", ims)
	}
	r := kvbox(t, append(sd, "new", "--image", "noagent", "--memory", "256M", name(t, "noagent"))...)
	if r.code == 0 || !strings.Contains(r.stderr, "has no kvbox-agent") || !strings.Contains(r.stderr, "--agent yes") {
		t.Errorf("new on an image without the agent: %s", r)
	}
}

// The folder of a box whose removal a killed kvbox left half-done (domain
// undefined, folder and its removal marker still there) is removed by the
// next command, which says so. A folder with no domain and no marker (an
// operator's virsh undefine, to define it again) is left as it is, and so
// is every live box's.
func TestOrphanBoxFolderIsRemoved(t *testing.T) {
	keep := name(t, "orphkeep")
	newBox(t, keep)
	n, op := name(t, "orphan"), name(t, "undefined")
	for _, d := range []string{n, op} {
		dir := filepath.Join(stateDir, "boxes", d)
		t.Cleanup(func() { os.RemoveAll(dir) })
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(dir, "disk.qcow2"), []byte("a disk"), 0o640)
	}
	os.WriteFile(filepath.Join(stateDir, "boxes", n, ".removing"), nil, 0o600)
	r := kvbox(t, "ls")
	if r.code != 0 || !strings.Contains(r.stderr, "removed the folder of box "+n) || strings.Contains(r.stderr, op) {
		t.Errorf("kvbox ls after a half-done removal: %s", r)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "boxes", n)); !os.IsNotExist(err) {
		t.Errorf("the half-removed box's folder is left: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(stateDir, "boxes", op, "disk.qcow2")); err != nil || string(b) != "a disk" {
		t.Errorf("the folder of an undefined box without the marker was touched: %q %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "boxes", keep, "disk.qcow2")); err != nil {
		t.Errorf("a live box's folder was touched: %v", err)
	}
	inBox(t, keep, "true")
}
