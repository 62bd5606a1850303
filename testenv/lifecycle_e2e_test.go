//go:build e2e

package testenv

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// newResult is an element of `kvbox new --count N --json`.
type newResult struct {
	Name  string `json:"name"`
	OK    bool   `json:"ok"`
	IP    string `json:"ip"`
	MAC   string `json:"mac"`
	Error string `json:"error"`
}

// TestCountClones: `new --from SNAP --count 3 PREFIX` starts PREFIX-1..3,
// each a working clone with its own name, MAC and address; a --count where
// one name is taken refuses before starting any.
func TestCountClones(t *testing.T) {
	srcName, snap, prefix := name(t, "nsrc"), name(t, "nwarm"), name(t, "n")
	newBox(t, srcName)
	inBox(t, srcName, "echo from-source > /root/mark")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", srcName, snap)

	names := []string{prefix + "-1", prefix + "-2", prefix + "-3"}
	t.Cleanup(func() { kvbox(t, append([]string{"rm", "--force"}, names...)...) })
	r := kvbox(t, "new", "--from", snap, "--count", "3", "--json", prefix)
	if r.code != 0 {
		t.Fatalf("kvbox new --count 3: %s", r)
	}
	var res []newResult
	if err := json.Unmarshal([]byte(r.stdout), &res); err != nil {
		t.Fatalf("kvbox new --count 3 --json: %v\n%s", err, r.stdout)
	}
	if len(res) != 3 {
		t.Fatalf("kvbox new --count 3 --json listed %d boxes: %s", len(res), r.stdout)
	}
	ips, macs := map[string]bool{getBox(t, srcName).IP: true}, map[string]bool{strings.ToLower(getBox(t, srcName).MAC): true}
	for i, x := range res {
		if x.Name != names[i] || !x.OK || x.Error != "" {
			t.Fatalf("box %d: %+v, want %s running", i, x, names[i])
		}
		b := getBox(t, x.Name)
		if b.State != "running" || b.IP != x.IP || !strings.EqualFold(b.MAC, x.MAC) || b.Snapshot != snap {
			t.Errorf("kvbox ls shows %+v for %+v", b, x)
		}
		if ips[b.IP] || macs[strings.ToLower(b.MAC)] {
			t.Errorf("box %s shares its address %s or MAC %s with another box", b.Name, b.IP, b.MAC)
		}
		ips[b.IP], macs[strings.ToLower(b.MAC)] = true, true
		got := inBox(t, x.Name, "hostname; cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0; cat /root/mark")
		for _, want := range []string{x.Name + "\n", strings.ToLower(b.MAC), b.IP + "/", "from-source"} {
			if !strings.Contains(got, want) {
				t.Errorf("in %s: %q lacks %q", x.Name, got, want)
			}
		}
	}
	// Each clone answers on its own address (boxes cannot reach each other).
	for _, x := range res {
		hostPing(t, x.IP)
	}

	// One name of the next --count is taken (prefix-2 of a new prefix):
	// nothing is started.
	p2 := name(t, "m")
	taken := p2 + "-2"
	t.Cleanup(func() { kvbox(t, "rm", "--force", p2+"-1", p2+"-3") })
	newBox(t, taken)
	before := domains(t)
	r = kvbox(t, "new", "--from", snap, "--count", "3", p2)
	if r.code != 4 {
		t.Fatalf("kvbox new --count 3 with %s taken: want exit 4: %s", taken, r)
	}
	if lines := strings.Split(strings.TrimSpace(r.stderr), "\n"); len(lines) != 1 || !strings.Contains(lines[0], taken) || !strings.Contains(lines[0], "started none") {
		t.Errorf("refusal is not one line naming %s: %q", taken, r.stderr)
	}
	if r.stdout != "" {
		t.Errorf("refusal printed on stdout: %q", r.stdout)
	}
	after := domains(t)
	for d := range after {
		if !before[d] {
			t.Errorf("domain %s exists after the refused --count", d)
		}
	}
	for _, n := range []string{p2 + "-1", p2 + "-3"} {
		if after[n] {
			t.Errorf("box %s was started by the refused --count", n)
		}
	}

	// Clones that fail (their agent is given no time) each report their
	// error, the exit code is non-zero, and nothing of them is left.
	p3 := name(t, "f")
	t.Cleanup(func() { kvbox(t, "rm", "--force", p3+"-1", p3+"-2") })
	r = kvbox(t, "new", "--from", snap, "--count", "2", "--timeout", "1ms", p3)
	if r.code == 0 {
		t.Fatalf("kvbox new --count 2 --timeout 1ms succeeded: %s", r)
	}
	t.Logf("failing --count: %s", r)
	if !strings.Contains(r.stderr, "could not start any of the 2 boxes") {
		t.Errorf("stderr does not say none started: %q", r.stderr)
	}
	for _, n := range []string{p3 + "-1", p3 + "-2"} {
		if !strings.Contains(r.stdout, "✗ box "+n+" failed: ") {
			t.Errorf("output does not list %s's error: %q", n, r.stdout)
		}
		if domains(t)[n] {
			t.Errorf("domain %s is left after its clone failed", n)
		}
		if _, err := os.Stat(filepath.Join(stateDir, "boxes", n)); !os.IsNotExist(err) {
			t.Errorf("folder of %s is left after its clone failed: %v", n, err)
		}
	}
	if !strings.Contains(r.stdout, "0 of 2 boxes running") {
		t.Errorf("no summary line: %q", r.stdout)
	}

	// A bad prefix (a name too long once numbered) is refused as usage.
	if r := kvbox(t, "new", "--from", snap, "--count", "2", strings.Repeat("x", 62)); r.code != 2 {
		t.Errorf("--count with too long a name: want exit 2: %s", r)
	}
	if r := kvbox(t, "new", "--from", snap, "--count", "0", p2); r.code != 2 {
		t.Errorf("--count 0: want exit 2: %s", r)
	}
}

// domains are the names of every libvirt domain.
func domains(t *testing.T) map[string]bool {
	t.Helper()
	out, err := virsh("list", "--all", "--name")
	if err != nil {
		t.Fatalf("virsh list: %v %s", err, out)
	}
	m := map[string]bool{}
	for _, l := range strings.Fields(out) {
		m[l] = true
	}
	return m
}

// TestCountCold: --count with --image boots cold boxes in parallel, each
// listed with its address and working.
func TestCountCold(t *testing.T) {
	prefix := name(t, "k")
	names := []string{prefix + "-1", prefix + "-2"}
	t.Cleanup(func() { kvbox(t, append([]string{"rm", "--force"}, names...)...) })
	r := kvbox(t, append(append([]string{"new"}, smallBox...), "--count", "2", prefix)...)
	if r.code != 0 {
		t.Fatalf("kvbox new --image tiny --count 2: %s", r)
	}
	t.Logf("%s", r.stdout)
	seen := map[string]bool{}
	for _, n := range names {
		b := getBox(t, n)
		if !strings.Contains(r.stdout, "✓ box "+n+" is running at "+b.IP+" ") {
			t.Errorf("output does not list %s at %s: %q", n, b.IP, r.stdout)
		}
		if seen[b.IP] || seen[b.MAC] {
			t.Errorf("%s shares its address or MAC", n)
		}
		seen[b.IP], seen[b.MAC] = true, true
		if got := inBox(t, n, "hostname"); strings.TrimSpace(got) != n {
			t.Errorf("hostname in %s is %q", n, got)
		}
	}
	if !strings.Contains(r.stdout, "2 of 2 boxes running from image tiny") {
		t.Errorf("no summary line: %q", r.stdout)
	}
}

// reapers are the pids of live kvbox reapers of the named box or snapshot.
func reapers(kind, n string) []string {
	out, _ := exec.Command("ps", "-eo", "pid=,stat=,args=").Output()
	var pids []string
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) < 3 || strings.HasPrefix(f[1], "Z") {
			continue
		}
		if strings.Contains(l, " __reap "+kind+" "+n+" ") {
			pids = append(pids, f[0])
		}
	}
	return pids
}

// boxLeftovers says what of box n is left on the host: domain, folder,
// lock files, reaper.
func boxLeftovers(t *testing.T, n string) error {
	t.Helper()
	var left []string
	if domains(t)[n] {
		left = append(left, "domain")
	}
	for _, p := range []string{filepath.Join("boxes", n), filepath.Join("locks", n+".lock"), filepath.Join("reapers", "box-"+n+".lock")} {
		if _, err := os.Stat(filepath.Join(stateDir, p)); err == nil {
			left = append(left, p)
		}
	}
	if r := reapers("box", n); len(r) > 0 {
		left = append(left, "reaper "+strings.Join(r, ","))
	}
	if len(left) > 0 {
		return fmt.Errorf("box %s: left %s", n, strings.Join(left, ", "))
	}
	return nil
}

// dumpExpires is the <expires> of a domain's live XML, "" without one.
func dumpExpires(t *testing.T, n string) string {
	t.Helper()
	out, err := virsh("dumpxml", n)
	if err != nil {
		t.Fatalf("virsh dumpxml %s: %v %s", n, err, out)
	}
	_, rest, ok := strings.Cut(out, "<expires>")
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, "</expires>")
	return v
}

// TestTTL: boxes with --ttl (clones with --count, from a snapshot with its
// own --ttl) disappear at their deadline without any other kvbox command
// and leave nothing; the snapshot outlives its deadline while a clone of
// it runs and goes with the last one; kvbox ttl extends and clears; a box
// whose reaper is gone (as after a reboot) is removed by the next kvbox
// command.
func TestTTL(t *testing.T) {
	src, snap, keep, prefix := name(t, "tsrc"), name(t, "twarm"), name(t, "tkeep"), name(t, "tt")
	newBox(t, src)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	snapAt := time.Now()
	out := mustKvbox(t, "snapshots", "new", "--ttl", "15s", src, snap)
	if !strings.Contains(out, "removed at ") {
		t.Errorf("snapshots new --ttl does not say when it goes: %q", out)
	}
	t.Cleanup(func() { kvbox(t, "rm", "--force", keep) })
	mustKvbox(t, "new", "--from", snap, keep)

	names := []string{prefix + "-1", prefix + "-2"}
	t.Cleanup(func() { kvbox(t, append([]string{"rm", "--force"}, names...)...) })
	start := time.Now()
	r := kvbox(t, "new", "--from", snap, "--count", "2", "--ttl", "20s", "--json", prefix)
	if r.code != 0 {
		t.Fatalf("new --count 2 --ttl 20s: %s", r)
	}
	var res []struct {
		Name    string    `json:"name"`
		Expires time.Time `json:"expires"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &res); err != nil || len(res) != 2 {
		t.Fatalf("new --json: %v %s", err, r.stdout)
	}
	for _, x := range res {
		if d := x.Expires.Sub(start); d < 18*time.Second || d > 22*time.Second {
			t.Errorf("%s expires %v after the start, want 20s", x.Name, d)
		}
		if got := dumpExpires(t, x.Name); got != x.Expires.UTC().Format(time.RFC3339) {
			t.Errorf("virsh dumpxml %s shows <expires>%s</expires>, want %s", x.Name, got, x.Expires.UTC().Format(time.RFC3339))
		}
		if len(reapers("box", x.Name)) != 1 {
			t.Errorf("%s has reapers %v, want one", x.Name, reapers("box", x.Name))
		}
	}
	// No kvbox command from here until both are gone: only virsh, ps and
	// the file system are looked at.
	for _, n := range names {
		eventually(t, 20*time.Second+time.Until(start.Add(60*time.Second)), func() error { return boxLeftovers(t, n) })
	}
	t.Logf("both --ttl 20s clones gone %.1fs after the start", time.Since(start).Seconds())

	// The snapshot's deadline has passed, but box keep is cloned from it.
	if d := time.Until(snapAt.Add(17 * time.Second)); d > 0 {
		time.Sleep(d)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "snapshots", snap)); err != nil {
		t.Fatalf("snapshot %s went while box %s is cloned from it: %v", snap, keep, err)
	}
	if ls := mustKvbox(t, "snapshots", "ls"); !strings.Contains(ls, "expired, kept until its 1 clone(s) are gone") {
		t.Errorf("snapshots ls does not say the expired snapshot is kept for its clone:\n%s", ls)
	}
	mustKvbox(t, "rm", "--force", keep)
	if _, err := os.Stat(filepath.Join(stateDir, "snapshots", snap)); !os.IsNotExist(err) {
		t.Errorf("expired snapshot %s is left after its last clone was removed: %v", snap, err)
	}
	if r := reapers("snapshot", snap); len(r) > 0 {
		t.Errorf("snapshot reapers left: %v", r)
	}

	// kvbox ttl: bad input, then extend, then clear.
	for _, bad := range [][]string{{"ttl", src, "0"}, {"ttl", src, "bogus"}, {"ttl", src, "-5m"}, {"ttl", src}} {
		if r := kvbox(t, bad...); r.code != 2 {
			t.Errorf("kvbox %v: want exit 2: %s", bad, r)
		}
	}
	if r := kvbox(t, "ttl", name(t, "nosuchbox"), "1h"); r.code != 3 {
		t.Errorf("kvbox ttl of no box: want exit 3: %s", r)
	}
	mustKvbox(t, "ttl", src, "6s")
	first := dumpExpires(t, src)
	mustKvbox(t, "ttl", src, "1h")
	if later := dumpExpires(t, src); later == "" || later <= first {
		t.Errorf("kvbox ttl 1h: <expires> %q, was %q", later, first)
	}
	time.Sleep(10 * time.Second)
	if !domains(t)[src] {
		t.Fatalf("box %s went at its old deadline although kvbox ttl extended it", src)
	}
	if got := getBox(t, src); got.State != "running" {
		t.Errorf("box %s is %s", src, got.State)
	}
	if len(reapers("box", src)) != 1 {
		t.Errorf("%s has reapers %v after the extension, want one", src, reapers("box", src))
	}
	mustKvbox(t, "ttl", src, "none")
	if got := dumpExpires(t, src); got != "" {
		t.Errorf("kvbox ttl none left <expires>%s</expires>", got)
	}
	if r := reapers("box", src); len(r) > 0 {
		t.Errorf("kvbox ttl none left reapers %v", r)
	}
	if ls := mustKvbox(t, "ls"); !strings.Contains(ls, "TTL") {
		t.Errorf("kvbox ls has no TTL column:\n%s", ls)
	}

	// As after a reboot: the reaper is gone when the deadline passes; the
	// next kvbox command removes the box and says so.
	mustKvbox(t, "ttl", src, "3s")
	for _, pid := range reapers("box", src) {
		exec.Command("kill", "-9", pid).Run()
	}
	time.Sleep(5 * time.Second)
	if !domains(t)[src] {
		t.Fatalf("box %s went without its reaper", src)
	}
	r = kvbox(t, "snapshots", "ls")
	if !strings.Contains(r.stderr, "removed box "+src+", whose TTL ended") {
		t.Errorf("the first kvbox command after the deadline did not say it removed %s: %s", src, r)
	}
	if err := boxLeftovers(t, src); err != nil {
		t.Error(err)
	}
}

// qemuOf is the pid of a running QEMU of box n, "" when there is none.
func qemuOf(n string) string {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(cmd), "guest="+n+",") {
			if st, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil && !strings.Contains(string(st), ") Z ") {
				return e.Name()
			}
		}
	}
	return ""
}

// suspendChecks: box n is suspended: kvbox ls says so, virsh shows it shut
// off, no QEMU of it runs.
func suspendChecks(t *testing.T, n string) {
	t.Helper()
	if b := getBox(t, n); b.State != "suspended" {
		t.Errorf("kvbox ls shows %s %s, want suspended", n, b.State)
	}
	if out, _ := virsh("domstate", n); strings.TrimSpace(out) != "shut off" {
		t.Errorf("virsh domstate %s: %q, want shut off", n, out)
	}
	if pid := qemuOf(n); pid != "" {
		t.Errorf("a QEMU of suspended box %s runs: pid %s", n, pid)
	}
}

// TestSuspendResume: a suspended box has no QEMU; it resumes with its own
// name, MAC and address, a counter process counting on from where it was
// and its server still answering; an operator's virsh start fails and
// loses nothing; start resumes; a resumed box can be snapshotted; a clone
// of it suspends and resumes (twice); rm removes suspended boxes and their
// saved state.
func TestSuspendResume(t *testing.T) {
	src, snap, cl := name(t, "ssrc"), name(t, "swarm"), name(t, "scl")
	b0 := newBox(t, src)
	startCounter(t, src)
	inBox(t, src, "mkdir -p /www && echo s-"+src+" > /www/index.html && setsid httpd -p 8080 -h /www </dev/null >/dev/null 2>&1")
	pid0 := strings.TrimSpace(inBox(t, src, "pidof httpd"))
	assertCounting(t, src)
	c0 := counter(t, src)

	ts := time.Now()
	out := mustKvbox(t, "suspend", src)
	running := time.Since(ts)
	t.Logf("%s", out)
	if !strings.Contains(out, "is suspended") {
		t.Errorf("suspend output: %q", out)
	}
	suspendChecks(t, src)
	if r := kvbox(t, "exec", src, "--", "true"); r.code != 5 || !strings.Contains(r.stderr, "kvbox resume") {
		t.Errorf("exec in a suspended box: want exit 5 naming kvbox resume: %s", r)
	}
	if r := kvbox(t, "stop", src); r.code != 5 {
		t.Errorf("stop of a suspended box: want exit 5: %s", r)
	}
	if r := kvbox(t, "suspend", src); r.code != 5 {
		t.Errorf("suspend of a suspended box: want exit 5: %s", r)
	}
	// An operator's virsh start fails, says why, and changes nothing.
	out, err := virsh("start", src)
	if err == nil || !strings.Contains(out, "SUSPENDED-run-kvbox-resume-"+src) {
		t.Errorf("virsh start of a suspended box: want a failure naming kvbox resume: %v %s", err, out)
	}
	suspendChecks(t, src)
	time.Sleep(3 * time.Second) // the counter must not have run meanwhile

	// kvbox start of a suspended box resumes it.
	t1 := time.Now()
	out = mustKvbox(t, "start", src)
	running += time.Since(t1)
	t.Logf("%s (%.2fs)", strings.TrimSpace(out), time.Since(t1).Seconds())
	b1 := getBox(t, src)
	if b1.State != "running" || b1.IP != b0.IP || b1.MAC != b0.MAC || b1.UUID != b0.UUID {
		t.Errorf("resumed box %+v, was %+v", b1, b0)
	}
	if qemuOf(src) == "" {
		t.Errorf("no QEMU of resumed box %s", src)
	}
	c1 := counter(t, src)
	// It counts (at most 10 a second) while the suspend command runs up to
	// the pause and after the resume, never while suspended (3 s and more).
	if c1 < c0 || c1 > c0+5+int(running.Seconds()*10) {
		t.Errorf("counter %d before suspend, %d right after resume (%.1fs running): want it to go on from where it was", c0, c1, running.Seconds())
	}
	assertCounting(t, src)
	if got := strings.TrimSpace(inBox(t, src, "hostname; pidof httpd")); got != src+"\n"+pid0 {
		t.Errorf("after resume: hostname and httpd pid %q, want %s and %s", got, src, pid0)
	}
	if body, err := httpGet("http://" + b1.IP + ":8080/"); err != nil || strings.TrimSpace(body) != "s-"+src {
		t.Errorf("server of the resumed box: %q %v", body, err)
	}
	for _, f := range []string{"suspend/" + src + ".live.xml", "suspend/" + src + ".boot.xml"} {
		if _, err := os.Stat(filepath.Join(stateDir, f)); !os.IsNotExist(err) {
			t.Errorf("%s left after resume: %v", f, err)
		}
	}
	if out, _ := virsh("dumpxml", "--inactive", src); strings.Contains(out, "SUSPENDED") || strings.Contains(out, "suspended") {
		t.Errorf("the persistent definition still says suspended after resume")
	}

	// A snapshot of the resumed box; a clone of it suspends and resumes.
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)
	t.Cleanup(func() { kvbox(t, "rm", "--force", cl) })
	mustKvbox(t, "new", "--from", snap, cl)
	bc := getBox(t, cl)
	assertCounting(t, cl)
	// 30 MB in a tmpfs: RAM the resume must give back byte for byte.
	sum := inBox(t, cl, "mkdir -p /mem && mount -t tmpfs -o size=64m mem /mem && head -c 30000000 /dev/urandom > /mem/f && md5sum /mem/f")
	for round := 1; round <= 2; round++ {
		cc := counter(t, cl)
		t0 := time.Now()
		out := mustKvbox(t, "suspend", cl)
		running := time.Since(t0)
		t.Logf("clone round %d: %s", round, strings.TrimSpace(out))
		suspendChecks(t, cl)
		if round == 1 {
			// A resume killed once its saved state is readied (the page
			// bitmap zeroed, QEMU defined to map it): the box is suspended
			// again, and the next resume starts from the same state.
			cmd := exec.Command(kvboxBin, "resume", cl)
			cmd.Env = append(os.Environ(), "KVBOX_TEST_KILL_AT=start-paused")
			if out, err := cmd.CombinedOutput(); err == nil {
				t.Fatalf("resume with KVBOX_TEST_KILL_AT=start-paused was not killed: %s", out)
			}
			mustKvbox(t, "ls")
			suspendChecks(t, cl)
		}
		time.Sleep(3 * time.Second)
		t0 = time.Now()
		out = mustKvbox(t, "resume", "-v", cl)
		running += time.Since(t0)
		t.Logf("clone round %d: %s", round, strings.TrimSpace(out))
		b := getBox(t, cl)
		if b.State != "running" || b.IP != bc.IP || b.MAC != bc.MAC {
			t.Errorf("resumed clone %+v, was %+v", b, bc)
		}
		// It counts (at most 10 a second) while the RAM is copied live and
		// after the resume, never while suspended.
		if c := counter(t, cl); c < cc || c > cc+5+int(running.Seconds()*10) {
			t.Errorf("clone counter %d before suspend, %d after resume (%.1fs running): want it to go on from where it was", cc, c, running.Seconds())
		}
		assertCounting(t, cl)
		if got := strings.TrimSpace(inBox(t, cl, "hostname")); got != cl {
			t.Errorf("resumed clone's hostname %q", got)
		}
		if got := inBox(t, cl, "md5sum /mem/f"); got != sum {
			t.Errorf("clone round %d: the file in its tmpfs is %q after resume, %q before", round, got, sum)
		}
		if body, err := httpGet("http://" + b.IP + ":8080/"); err != nil || strings.TrimSpace(body) != "s-"+src {
			t.Errorf("server of the resumed clone: %q %v", body, err)
		}
		// The resumed clone maps its RAM from the state it was saved in:
		// that one stays while it runs, none other.
		live, _ := virsh("dumpxml", cl)
		if states, _ := filepath.Glob(filepath.Join(b.Dir, "suspend-*.state")); len(states) != 1 || !strings.Contains(live, states[0]+",") {
			t.Errorf("clone folder holds saved states %v after resume; want the one its QEMU maps", states)
		}
	}
	// A cold boot needs no saved state: kvbox start deletes it.
	mustKvbox(t, "stop", "--force", cl)
	mustKvbox(t, "start", cl)
	if states, _ := filepath.Glob(filepath.Join(bc.Dir, "suspend-*.state")); len(states) != 0 {
		t.Errorf("clone folder holds saved states %v after a cold boot", states)
	}

	// rm of suspended boxes: a clone, then the source (no --force needed).
	for _, n := range []string{cl, src} {
		mustKvbox(t, "suspend", n)
		mustKvbox(t, "rm", n)
		if err := boxLeftovers(t, n); err != nil {
			t.Error(err)
		}
		for _, k := range []string{"live", "boot"} {
			if _, err := os.Stat(filepath.Join(stateDir, "suspend", n+"."+k+".xml")); !os.IsNotExist(err) {
				t.Errorf("rm of suspended %s left its %s XML: %v", n, k, err)
			}
		}
	}
}

// TestCountLateAgent: in a --count, one clone whose agent stays silent
// (KVBOX_TEST_SILENT_AGENT: kvbox takes its agent's answers for none) fails
// alone after --timeout, is cleaned up (domain, folder, address, locks),
// and the others run and work.
func TestCountLateAgent(t *testing.T) {
	src, snap, prefix := name(t, "lsrc"), name(t, "lwarm"), name(t, "la")
	newBox(t, src)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)
	names := []string{prefix + "-1", prefix + "-2", prefix + "-3"}
	t.Cleanup(func() { kvbox(t, append([]string{"rm", "--force"}, names...)...) })
	late := names[1]
	cmd := exec.Command(kvboxBin, "new", "--from", snap, "--count", "3", "--timeout", "20s", prefix)
	cmd.Env = append(os.Environ(), "KVBOX_TEST_SILENT_AGENT="+late)
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err == nil {
		t.Fatalf("new --count 3 with a silent agent in %s succeeded", late)
	}
	if !strings.Contains(string(out), "✗ box "+late+" failed: ") || !strings.Contains(string(out), "did not answer in time") {
		t.Errorf("output does not give %s's agent timeout: %s", late, out)
	}
	if !strings.Contains(string(out), "2 of 3 boxes running") {
		t.Errorf("no summary saying 2 of 3 run: %s", out)
	}
	if err := boxLeftovers(t, late); err != nil {
		t.Error(err)
	}
	for _, n := range []string{names[0], names[2]} {
		b := getBox(t, n)
		if b.State != "running" {
			t.Errorf("%s is %s", n, b.State)
		}
		if got := strings.TrimSpace(inBox(t, n, "hostname")); got != n {
			t.Errorf("hostname in %s: %q", n, got)
		}
	}
}

// TestSuspendKilled: a kvbox killed in the middle of a suspend or a resume
// loses nothing; the next kvbox command finishes or undoes it, by what the
// guest may have done since: killed while saving, the box runs on; killed
// once its state is saved and its definition says so, it is suspended;
// killed while resuming before the guest ran, it is suspended again; killed
// after the guest ran, it runs, as itself.
func TestSuspendKilled(t *testing.T) {
	n := name(t, "kill")
	b0 := newBox(t, n)
	startCounter(t, n)
	killAt := func(point string, args ...string) {
		t.Helper()
		cmd := exec.Command(kvboxBin, args...)
		cmd.Env = append(os.Environ(), "KVBOX_TEST_KILL_AT="+point)
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
			t.Fatalf("kvbox %v with KVBOX_TEST_KILL_AT=%s was not killed: %v %s", args, point, err, out)
		}
		if r := kvbox(t, "ls"); r.code != 0 || strings.Contains(r.stderr, "warning") {
			t.Errorf("kvbox ls after the kill at %s: %s", point, r)
		}
	}
	running := func(point string) {
		t.Helper()
		b := getBox(t, n)
		if b.State != "running" || b.IP != b0.IP || b.MAC != b0.MAC {
			t.Fatalf("after a kill at %s: %+v", point, b)
		}
		assertCounting(t, n)
		if out, _ := virsh("dumpxml", "--inactive", n); strings.Contains(out, "SUSPENDED") || strings.Contains(out, "suspended>") {
			t.Errorf("after a kill at %s the persistent definition still says suspended", point)
		}
		if m, _ := filepath.Glob(filepath.Join(stateDir, "suspend", n+".*")); len(m) > 0 {
			t.Errorf("after a kill at %s: suspend files left %v", point, m)
		}
	}

	// The points are the plans' step names (suspend/suspend.go, suspend/wake.go).
	killAt("save-live", "suspend", n)
	running("save-live")

	c0 := counter(t, n)
	killAt("define-suspended", "suspend", n)
	suspendChecks(t, n)

	killAt("start-paused", "resume", n)
	suspendChecks(t, n)

	killAt("resume", "resume", n)
	running("resume")
	if c := counter(t, n); c < c0 {
		t.Errorf("counter %d after the kills, %d before: the saved state was lost", c, c0)
	}
	// And it still suspends and resumes.
	mustKvbox(t, "suspend", n)
	suspendChecks(t, n)
	mustKvbox(t, "resume", n)
	running("the end")
	// A resumed box maps its RAM from its saved state: a suspend killed
	// while it saves again leaves that state, and only that one.
	killAt("save-live", "suspend", n)
	running("save-live of a resumed box")
	live, _ := virsh("dumpxml", n)
	if states, _ := filepath.Glob(filepath.Join(b0.Dir, "suspend-*.state")); len(states) != 1 || !strings.Contains(live, states[0]+",") {
		t.Errorf("after a kill at save-live of a resumed box: saved states %v; want the one its QEMU maps", states)
	}
}

// TestSuspendKilledSetsBackWhatItFound: a suspend killed while it saves
// is undone to the migration settings the box had, not to QEMU's
// defaults: the suspend records them before it changes them.
func TestSuspendKilledSetsBackWhatItFound(t *testing.T) {
	n := name(t, "killset")
	newBox(t, n)
	const set = `{"execute":"migrate-set-parameters","arguments":{"max-bandwidth":67108864,"downtime-limit":123}}`
	if out, err := virsh("qemu-monitor-command", n, set); err != nil {
		t.Fatalf("set the box's migration parameters: %v %s", err, out)
	}
	for _, point := range []string{"set-migration", "save-live"} {
		cmd := exec.Command(kvboxBin, "suspend", n)
		cmd.Env = append(os.Environ(), "KVBOX_TEST_KILL_AT="+point)
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
			t.Fatalf("kvbox suspend with KVBOX_TEST_KILL_AT=%s was not killed: %v %s", point, err, out)
		}
		if b := getBox(t, n); b.State != "running" { // the next command recovered it
			t.Fatalf("after a kill at %s the box is %s", point, b.State)
		}
		var params struct {
			Return struct {
				MaxBandwidth  int64 `json:"max-bandwidth"`
				DowntimeLimit int64 `json:"downtime-limit"`
			} `json:"return"`
		}
		qmpJSON(t, n, `{"execute":"query-migrate-parameters"}`, &params)
		if p := params.Return; p.MaxBandwidth != 64<<20 || p.DowntimeLimit != 123 {
			t.Errorf("after a kill at %s the migration parameters are %+v, not what the box had", point, p)
		}
	}
}
