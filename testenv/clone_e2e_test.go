//go:build e2e

package testenv

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// snapshotSums hashes every file of a snapshot folder.
func snapshotSums(t *testing.T, snap string) map[string]string {
	t.Helper()
	dir := filepath.Join(stateDir, "snapshots", snap)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	sums := map[string]string{}
	for _, e := range ents {
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		h := sha256.New()
		io.Copy(h, f)
		f.Close()
		sums[e.Name()] = hex.EncodeToString(h.Sum(nil))
	}
	return sums
}

func httpGet(url string) (string, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// newClone runs `kvbox new --from` and removes the clone when the test ends.
func newClone(t *testing.T, snap, n string) result {
	t.Helper()
	t.Cleanup(func() { kvbox(t, "rm", "--force", n) })
	return kvbox(t, "new", "-v", "--from", snap, n)
}

// capture runs tcpdump in this namespace until stop is called and returns
// its lines.
func capture(t *testing.T, args ...string) (stop func() []string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, "tcpdump", append([]string{"-l", "-n", "-e", "-tt", "-U"}, args...)...)
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var errb strings.Builder
	cmd.Stderr = &errb
	if err := cmd.Start(); err != nil {
		t.Fatalf("tcpdump: %v", err)
	}
	lines := make(chan []string, 1)
	go func() {
		var ls []string
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			ls = append(ls, sc.Text())
		}
		lines <- ls
	}()
	// tcpdump says "listening on" once its socket is open.
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(errb.String(), "listening on") && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	return func() []string {
		time.Sleep(300 * time.Millisecond)
		cancel()
		ls := <-lines
		cmd.Wait()
		return ls
	}
}

// guestClock is the guest's time of day, to the microsecond.
func guestClock(t *testing.T, n string) (float64, time.Time, time.Time) {
	t.Helper()
	before := time.Now()
	out := inBox(t, n, "adjtimex")
	after := time.Now()
	sec := regexp.MustCompile(`time\.tv_sec:\s+(\d+)`).FindStringSubmatch(out)
	usec := regexp.MustCompile(`time\.tv_usec:\s+(\d+)`).FindStringSubmatch(out)
	if sec == nil || usec == nil {
		t.Fatalf("adjtimex in %s: %q", n, out)
	}
	s, _ := strconv.ParseFloat(sec[1], 64)
	u, _ := strconv.ParseFloat(usec[1], 64)
	return s + u/1e6, before, after
}

func unixSec(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

// TestWarmClones: a box runs a web server, is snapshotted, and clones of
// the snapshot come up with the server running, each with its own
// identity, without a frame reaching the bridge before they are
// re-identified.
func TestWarmClones(t *testing.T) {
	srcName, snap := name(t, "csrc"), name(t, "cwarm")
	src := newBox(t, srcName)
	inBox(t, srcName, "mkdir -p /www && echo warm-"+srcName+" > /www/index.html && "+
		"setsid httpd -p 8080 -h /www </dev/null >/dev/null 2>&1; sleep 0.3; netstat -ltn | grep -q :8080")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", srcName, snap)
	sums := snapshotSums(t, snap)
	// Let the snapshot's clock fall behind, so a clone that kept it shows.
	time.Sleep(3 * time.Second)

	// The first clone comes up while the source is paused: any frame with
	// the source's MAC on the bridge is then the clone's.
	c1, c2 := name(t, "c1"), name(t, "c2")
	if out, err := virsh("suspend", srcName); err != nil {
		t.Fatalf("suspend the source: %v %s", err, out)
	}
	stopBridge := capture(t, "-i", cloneBridge)
	stopAny := capture(t, "-i", "any", "not", "ip6")
	r := newClone(t, snap, c1)
	bridgeLines, anyLines := stopBridge(), stopAny()
	if out, err := virsh("resume", srcName); err != nil {
		t.Fatalf("resume the source: %v %s", err, out)
	}
	if r.code != 0 {
		t.Fatalf("kvbox new --from %s %s: %s", snap, c1, r)
	}
	if !strings.Contains(r.stdout, "✓ box "+c1+" is running at "+subnetPrefix) || !strings.Contains(r.stdout, "from snapshot "+snap) {
		t.Errorf("kvbox new --from printed %q", r.stdout)
	}
	t.Logf("clone %s: %s", c1, strings.TrimSpace(r.stderr))
	a := getBox(t, c1)
	clockGuest, before, after := guestClock(t, c1)

	// Nothing of the clone reached the bridge before it was re-identified:
	// no frame with the source's MAC (paused, so it sent none) and every
	// frame from the clone's MAC already carries the clone's address.
	var fromClone int
	for _, l := range bridgeLines {
		low := strings.ToLower(l)
		if strings.Contains(low, strings.ToLower(src.MAC)+" >") {
			t.Errorf("bridge saw a frame from the source's MAC while the source was paused: %s", l)
		}
		if strings.Contains(low, strings.ToLower(a.MAC)+" >") {
			fromClone++
			if strings.Contains(l, src.IP) && !strings.Contains(l, a.IP) {
				t.Errorf("bridge saw the clone with the source's address: %s", l)
			}
		}
	}
	var onTap int
	for _, l := range anyLines {
		if strings.Contains(l, a.Tap) && strings.Contains(strings.ToLower(l), strings.ToLower(src.MAC)) {
			onTap++
		}
	}
	t.Logf("bridge: %d frames, %d from the clone's MAC; the clone's tap carried %d frames with the source's MAC (dropped: the port was closed)",
		len(bridgeLines), fromClone, onTap)

	// Identity inside the clone is the new one.
	got := inBox(t, c1, "hostname; cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0")
	for _, want := range []string{c1 + "\n", a.MAC, a.IP + "/24"} {
		if !strings.Contains(got, want) {
			t.Errorf("clone %s: %q lacks %q", c1, got, want)
		}
	}
	if strings.Contains(got, src.MAC) || strings.Contains(got, src.IP+"/") {
		t.Errorf("clone %s still has the source's identity: %q", c1, got)
	}
	if a.IP == src.IP || a.MAC == src.MAC || a.UUID == src.UUID || a.Snapshot != snap || a.State != "running" {
		t.Errorf("clone: %+v, source: %+v", a, src)
	}
	// The guest clock is the host's, not the snapshot's.
	if clockGuest < unixSec(before)-1 || clockGuest > unixSec(after)+1 {
		t.Errorf("guest clock %.3f, host %.3f..%.3f", clockGuest, unixSec(before), unixSec(after))
	}

	// The server started before the snapshot answers on the clone's own
	// address, and the source still answers on its own: side by side.
	for _, b := range []box{a, src} {
		var body string
		var err error
		// The source was paused a while; give a busy 2-core host time.
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(time.Second) {
			if body, err = httpGet("http://" + b.IP + ":8080/"); err == nil {
				break
			}
		}
		if err != nil || strings.TrimSpace(body) != "warm-"+srcName {
			neigh, _ := exec.Command("ip", "neigh").CombinedOutput()
			t.Errorf("http://%s:8080/ (%s): %q %v\nip neigh: %s\nin the box: %s", b.IP, b.Name, body, err, neigh,
				kvbox(t, "exec", b.Name, "--", "sh", "-c", "ip -4 -o addr; cat /sys/class/net/eth0/address; netstat -ltn; ping -c 1 -W 2 "+cloneGateway))
		}
	}

	// Two clones never produce the same random bytes.
	if r := newClone(t, snap, c2); r.code != 0 {
		t.Fatalf("kvbox new --from %s %s: %s", snap, c2, r)
	}
	results := make([]string, 2)
	parallel(2, func(i int) {
		results[i] = inBox(t, []string{c1, c2}[i], "head -c 32 /dev/urandom | xxd -p | tr -d '\\n'")
	})
	if len(results[0]) != 64 || results[0] == results[1] {
		t.Errorf("urandom: %q and %q", results[0], results[1])
	}
	b := getBox(t, c2)
	if b.IP == a.IP || b.MAC == a.MAC {
		t.Errorf("two clones share an identity: %+v %+v", a, b)
	}
	// Each clone answers on its own address (boxes cannot reach each other).
	hostPing(t, a.IP)
	hostPing(t, b.IP)

	// libvirt keeps a clone like any domain: save and restore work (no
	// migration capability was left on), the domain is not paused.
	if out, err := virsh("domstate", c1); err != nil || !strings.Contains(out, "running") {
		t.Errorf("virsh domstate %s: %s %v", c1, out, err)
	}
	img := filepath.Join(t.TempDir(), "save")
	if out, err := virsh("save", c1, img); err != nil {
		t.Errorf("virsh save %s: %s %v", c1, out, err)
	} else if out, err := virsh("restore", img); err != nil {
		t.Errorf("virsh restore %s: %s %v", c1, out, err)
	} else if got := inBox(t, c1, "hostname"); got != c1+"\n" {
		t.Errorf("after restore: hostname %q", got)
	}

	// rm deletes the clone and leaves the snapshot untouched.
	mustKvbox(t, "rm", "--force", c1, c2)
	if got := snapshotSums(t, snap); fmt.Sprint(got) != fmt.Sprint(sums) {
		t.Errorf("snapshot changed after clones ran and were removed:\n%v\n%v", sums, got)
	}
	if _, err := os.Stat(a.Dir); !os.IsNotExist(err) {
		t.Errorf("clone folder %s is still there: %v", a.Dir, err)
	}
}

// TestTenClonesInParallel: ten clones of one snapshot at once get distinct
// identities, all serve, and share the snapshot's memory file in the page
// cache.
func TestTenClonesInParallel(t *testing.T) {
	srcName, snap := name(t, "psrc"), name(t, "pwarm")
	newBox(t, srcName)
	inBox(t, srcName, "mkdir -p /www && echo p-"+srcName+" > /www/index.html && setsid httpd -p 8080 -h /www </dev/null >/dev/null 2>&1")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", srcName, snap)
	sums := snapshotSums(t, snap)
	const n = 10
	names := make([]string, n)
	results := make([]result, n)
	for i := range names {
		names[i] = name(t, fmt.Sprintf("p%d", i))
		t.Cleanup(func() { kvbox(t, "rm", "--force", names[i]) })
	}
	start := time.Now()
	parallel(n, func(i int) { results[i] = kvbox(t, "new", "--from", snap, names[i]) })
	t.Logf("%d clones in parallel: %v", n, time.Since(start))
	ips, macs := map[string]bool{}, map[string]bool{}
	for i, r := range results {
		if r.code != 0 {
			t.Fatalf("clone %s: %s", names[i], r)
		}
		t.Logf("%s: %s", names[i], strings.TrimSpace(r.stderr))
		b := getBox(t, names[i])
		if ips[b.IP] || macs[b.MAC] {
			t.Errorf("clone %s shares an address or MAC: %+v", b.Name, b)
		}
		ips[b.IP], macs[b.MAC] = true, true
		if body, err := httpGet("http://" + b.IP + ":8080/"); err != nil || strings.TrimSpace(body) != "p-"+srcName {
			t.Errorf("http://%s:8080/ (%s): %q %v", b.IP, b.Name, body, err)
		}
	}

	// PSS: the snapshot's memory file is mapped by every clone and its
	// pages are shared: the clones' PSS of that mapping adds up to about
	// one copy, not ten.
	memFile := filepath.Join(stateDir, "snapshots", snap, "state")
	var rss, pss, total int64
	for _, nm := range names {
		pid := strings.TrimSpace(readFile(t, "/run/libvirt/qemu/"+nm+".pid"))
		r, p := mappingKB(t, "/proc/"+pid+"/smaps", memFile)
		rss += r
		pss += p
		total += fieldKB(readFile(t, "/proc/"+pid+"/smaps_rollup"), "Pss")
	}
	t.Logf("%d clones: snapshot memory file mapped Rss %d MB, Pss %d MB; total Pss of the QEMU processes %d MB (%d MB each)",
		n, rss>>10, pss>>10, total>>10, total/n>>10)
	if rss == 0 || pss*3 > rss {
		t.Errorf("the snapshot memory file is not shared between clones: Rss %d kB, Pss %d kB", rss, pss)
	}
	mustKvbox(t, append([]string{"rm", "--force"}, names...)...)
	if got := snapshotSums(t, snap); fmt.Sprint(got) != fmt.Sprint(sums) {
		t.Errorf("snapshot changed:\n%v\n%v", sums, got)
	}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func fieldKB(s, field string) int64 {
	m := regexp.MustCompile(`(?m)^` + field + `:\s+(\d+) kB`).FindStringSubmatch(s)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseInt(m[1], 10, 64)
	return v
}

// mappingKB sums Rss and Pss of the mappings of file in an smaps file.
func mappingKB(t *testing.T, smaps, file string) (rss, pss int64) {
	t.Helper()
	s := readFile(t, smaps)
	hdr := regexp.MustCompile(`(?m)^[0-9a-f]+-[0-9a-f]+ `)
	idx := hdr.FindAllStringIndex(s, -1)
	for i, loc := range idx {
		end := len(s)
		if i+1 < len(idx) {
			end = idx[i+1][0]
		}
		block := s[loc[0]:end]
		first, _, _ := strings.Cut(block, "\n")
		if strings.HasSuffix(first, " "+file) {
			rss += fieldKB(block, "Rss")
			pss += fieldKB(block, "Pss")
		}
	}
	return rss, pss
}

// TestCloneAgentTimeoutRollsBack: a snapshot whose agent does not answer
// gives a clone that fails with a clear error and leaves nothing behind.
func TestCloneAgentTimeoutRollsBack(t *testing.T) {
	srcName, snap, c := name(t, "tsrc"), name(t, "tdead"), name(t, "tc")
	t.Cleanup(func() { os.Remove(filepath.Join(stateDir, "logs", c+".console.log")) })
	src := newBox(t, srcName)
	// Freeze the agent as soon as it took the snapshot's token, before its
	// memory is copied (kvbox refuses to copy the memory of a box whose
	// agent does not take one): the snapshot then holds a guest whose agent
	// never answers, and the source box, whose agent cannot take a token of
	// its own afterwards, keeps the snapshot's, as the note says.
	// The watch runs shell builtins only (a fork under TCG can take longer
	// than the copy): it reads the token every 10 ms (a read -t on a FIFO
	// nobody writes), and once it changed gives the agent 30 ms to answer
	// the host, then stops it by a pid it read before: after the answer,
	// well before the copy's last pass.
	inBox(t, srcName, `t=/var/lib/kvbox-agent/token; read -r old < $t; p=$(pidof kvbox-agent); mkfifo /tmp/agent-watch
		(exec 3<>/tmp/agent-watch; while read -r cur < $t; [ "$cur" = "$old" ]; do read -t 0.01 x <&3; done; read -t 0.03 x <&3; kill -STOP $p) </dev/null >/dev/null 2>&1 &`)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	r0 := kvbox(t, "snapshots", "new", srcName, snap)
	if r0.code != 0 {
		t.Fatalf("snapshot of a box whose agent stops once it took the snapshot's token: %s", r0)
	}
	if !strings.Contains(r0.stderr, "keeps the snapshot's agent token") {
		t.Errorf("no note that the box keeps the snapshot's token: %s", r0)
	}
	mustKvbox(t, "rm", "--force", srcName) // it can't be used any more; its address is free now
	stop := capture(t, "-i", cloneBridge)
	start := time.Now()
	t.Cleanup(func() { kvbox(t, "rm", "--force", c) })
	r := kvbox(t, "new", "--from", snap, "--timeout", "5s", c)
	lines := stop()
	if r.code == 0 {
		t.Fatalf("kvbox new --from a snapshot with a dead agent succeeded: %s", r)
	}
	if !strings.Contains(r.stderr, "agent") || !strings.Contains(r.stderr, "did not answer") {
		t.Errorf("error does not say the agent did not answer: %s", r)
	}
	t.Logf("failed after %v: %s", time.Since(start), strings.TrimSpace(r.stderr))
	if out, err := virsh("dominfo", c); err == nil {
		t.Errorf("domain %s is still defined: %s", c, out)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "boxes", c)); !os.IsNotExist(err) {
		t.Errorf("folder of %s is still there: %v", c, err)
	}
	for _, b := range listBoxes(t) {
		if b.Name == c {
			t.Errorf("kvbox ls still lists %s", c)
		}
	}
	for _, l := range lines {
		if strings.Contains(strings.ToLower(l), strings.ToLower(src.MAC)+" >") {
			t.Errorf("the dead clone reached the bridge with the source's identity: %s", l)
		}
	}
}

// TestCloneOfAClone: a clone is snapshotted again (its RAM is private, so
// the snapshot keeps it in the mapped-ram state file) and clones of that
// snapshot work the same way.
func TestCloneOfAClone(t *testing.T) {
	srcName, snap1, mid, snap2, leaf := name(t, "gsrc"), name(t, "g1"), name(t, "gmid"), name(t, "g2"), name(t, "gleaf")
	newBox(t, srcName)
	inBox(t, srcName, "mkdir -p /www && echo g-"+srcName+" > /www/index.html && setsid httpd -p 8080 -h /www </dev/null >/dev/null 2>&1")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap1) })
	mustKvbox(t, "snapshots", "new", srcName, snap1)
	if r := newClone(t, snap1, mid); r.code != 0 {
		t.Fatalf("clone %s: %s", mid, r)
	}
	inBox(t, mid, "echo from-mid > /www/mid.html")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap2) })
	mustKvbox(t, "snapshots", "new", mid, snap2)
	r := newClone(t, snap2, leaf)
	if r.code != 0 {
		t.Fatalf("clone %s of %s: %s", leaf, snap2, r)
	}
	t.Logf("grandchild: %s", strings.TrimSpace(r.stderr))
	l := getBox(t, leaf)
	for path, want := range map[string]string{"/": "g-" + srcName, "/mid.html": "from-mid"} {
		if body, err := httpGet("http://" + l.IP + ":8080" + path); err != nil || strings.TrimSpace(body) != want {
			t.Errorf("grandchild http %s: %q %v", path, body, err)
		}
	}
	if got := inBox(t, leaf, "hostname"); got != leaf+"\n" {
		t.Errorf("grandchild hostname %q", got)
	}
	// The first snapshot cannot go while a clone maps it; once its clone is
	// gone it can, and the second snapshot (merged, standalone) lives on.
	r = kvbox(t, "snapshots", "rm", snap1)
	if r.code == 0 || !strings.Contains(r.stderr, mid) {
		t.Fatalf("snapshots rm of a snapshot with a running clone: %s", r)
	}
	mustKvbox(t, "rm", "--force", mid, leaf)
	mustKvbox(t, "snapshots", "rm", snap1)
	again := name(t, "gleaf2")
	if r := newClone(t, snap2, again); r.code != 0 {
		t.Fatalf("clone of %s after %s was deleted: %s", snap2, snap1, r)
	}
	a := getBox(t, again)
	if body, err := httpGet("http://" + a.IP + ":8080/mid.html"); err != nil || strings.TrimSpace(body) != "from-mid" {
		t.Errorf("clone of the second snapshot after the first was deleted: %q %v", body, err)
	}
}

// cloneBridge is the bridge the test boxes are on: KVBOX_BRIDGE, as for
// the CLI, or kvbox's default.
var cloneBridge = envOr("KVBOX_BRIDGE", "kvbox0")

// cloneGateway is the host's address on it (the subnet's first address).
var cloneGateway = subnetPrefix + "1"

// A clone is a box like any other: stopped and started again it cold-boots
// from its own disk (not the snapshot's memory) and keeps its identity.
func TestCloneStopStart(t *testing.T) {
	src, snap, c := name(t, "sssrc"), name(t, "sswarm"), name(t, "ssclone")
	newBox(t, src)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)
	if r := newClone(t, snap, c); r.code != 0 {
		t.Fatalf("clone: %s", r)
	}
	before := getBox(t, c)
	inBox(t, c, "echo from-clone > /root/mark; sync")
	mustKvbox(t, "stop", c)
	mustKvbox(t, "start", c)
	after := getBox(t, c)
	if after.State != "running" || after.IP != before.IP || after.MAC != before.MAC || after.Snapshot != snap {
		t.Fatalf("after stop/start: %+v, before %+v", after, before)
	}
	got := inBox(t, c, "hostname; cat /root/mark; cat /sys/class/net/eth0/address; cut -d' ' -f1 /proc/uptime")
	for _, want := range []string{c + "\n", "from-clone\n", before.MAC} {
		if !strings.Contains(got, want) {
			t.Errorf("cold-booted clone shows %q, lacks %q", got, want)
		}
	}
	// And it still keeps the snapshot from being deleted: its disk is an
	// overlay on the snapshot's.
	if r := kvbox(t, "snapshots", "rm", snap); r.code == 0 {
		t.Errorf("snapshots rm while a stopped clone builds on it succeeded")
	}
}

// A kvbox killed while creating a box or a clone leaves nothing that
// lasts: the next command removes the half-made box, its folder and its
// address.
func TestKilledCreationIsCleanedUp(t *testing.T) {
	src, snap := name(t, "kcsrc"), name(t, "kcwarm")
	newBox(t, src)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)
	for _, tc := range []struct {
		step string
		args []string
	}{
		// The steps of the box plan (domain.Creation.Plan) and of the
		// clone's edit of it (snapshot.Clone).
		{"define", smallBox},
		{"start", smallBox},
		{"agent", smallBox},
		{"define", []string{"--from", snap}},
		{"close-port", []string{"--from", snap}},
		{"load", []string{"--from", snap}},
		{"resume", []string{"--from", snap}},
		{"open-port", []string{"--from", snap}},
	} {
		n := name(t, "k-"+tc.step+fmt.Sprint(len(tc.args)))
		t.Cleanup(func() { kvbox(t, "rm", "--force", n) })
		cmd := exec.Command(kvboxBin, append(append([]string{"new"}, tc.args...), n)...)
		cmd.Env = append(os.Environ(), "KVBOX_TEST_KILL_AT="+tc.step)
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
			t.Fatalf("kill at %s: kvbox ended with %v, want SIGKILL\n%s", tc.step, err, out)
		}
		r := kvbox(t, "ls", "--json")
		if r.code != 0 || strings.Contains(r.stdout, `"`+n+`"`) || !strings.Contains(r.stderr, "removed box "+n) {
			t.Errorf("kill at %s: the next command did not clean up: %s", tc.step, r)
		}
		if out, err := virsh("dominfo", n); err == nil {
			t.Errorf("kill at %s: domain left: %s", tc.step, out)
		}
		if _, err := os.Stat(filepath.Join(stateDir, "boxes", n)); !os.IsNotExist(err) {
			t.Errorf("kill at %s: folder left: %v", tc.step, err)
		}
	}
	if got := getBox(t, src).State; got != "running" {
		t.Errorf("the source is %s", got)
	}
}
