//go:build e2e

package testenv

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
