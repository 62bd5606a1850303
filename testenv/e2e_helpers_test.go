//go:build e2e

// End-to-end tests: they boot real guests through libvirt. Run them with
// `make e2e` (or the README's test command) after `make testenv`: the test
// process, libvirtd and every guest live in the network namespace
// kvbox-test, so no packet to a guest leaves it.
package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/statedir"
)

var (
	kvboxBin string // bin/kvbox built fresh for this run
	runID    string // prefix of every name this run creates
)

const testNetns = "kvbox-test"

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	out, _ := exec.Command("ip", "netns", "identify", fmt.Sprint(os.Getpid())).Output()
	if ns := strings.TrimSpace(string(out)); ns != testNetns {
		fmt.Fprintf(os.Stderr, "e2e tests must run inside the network namespace %s (they talk to guests): "+
			"ip netns exec %s go test -tags e2e ./testenv/... (make e2e); this process is in %q\n", testNetns, testNetns, ns)
		return 1
	}
	dir, err := os.MkdirTemp("", "kvbox-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	kvboxBin = filepath.Join(dir, "kvbox")
	build := exec.Command("go", "build", "-o", kvboxBin, "../cmd/kvbox")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build kvbox:", err)
		return 1
	}
	b := make([]byte, 3)
	rand.Read(b)
	runID = "e2e" + hex.EncodeToString(b)
	return m.Run()
}

// result is one kvbox run.
type result struct {
	stdout, stderr string
	code           int
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// kvbox runs the CLI with stdin.
func kvboxIn(t testing.TB, stdin string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdLimit)
	defer cancel()
	cmd := exec.CommandContext(ctx, kvboxBin, args...)
	// A command that hangs gets SIGQUIT: Go prints where every goroutine
	// is, and the test fails with that instead of the whole run stalling
	// until go test's timeout with no word of which command it was.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGQUIT) }
	// Output is read until every holder of the pipes has closed them; a
	// process kvbox left behind holding them would hold the test for good.
	cmd.WaitDelay = 30 * time.Second
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	cmd.Stdin = strings.NewReader(stdin)
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String()}
	if ctx.Err() != nil {
		t.Fatalf("kvbox %v did not end in %v: %v\n%s", args, cmdLimit, err, r)
	}
	if errors.Is(err, exec.ErrWaitDelay) {
		t.Fatalf("kvbox %v ended, but a process it left behind kept its output open:\n%s", args, r)
	}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run kvbox %v: %v", args, err)
	}
	return r
}

// cmdLimit bounds one kvbox command of a test; the longest (a cold image
// build, ten clones at once under TCG) take a few minutes.
const cmdLimit = 12 * time.Minute

func kvbox(t testing.TB, args ...string) result {
	t.Helper()
	return kvboxIn(t, "", args...)
}

// mustKvbox runs kvbox and fails the test unless it exits 0.
func mustKvbox(t testing.TB, args ...string) string {
	t.Helper()
	r := kvbox(t, args...)
	if r.code != 0 {
		t.Fatalf("kvbox %s: %s", strings.Join(args, " "), r)
	}
	return r.stdout
}

// name returns a box name unique to this run.
func name(t testing.TB, base string) string {
	return runID + "-" + base
}

// Small boxes: the test machine has 2 cores.
var smallBox = []string{"--image", "tiny", "--cpus", "1", "--memory", "256M", "--disk", "1G"}

// newBox starts a tiny box and removes it when the test ends.
func newBox(t testing.TB, n string, extra ...string) box {
	t.Helper()
	t.Cleanup(func() { kvbox(t, "rm", "--force", n) })
	mustKvbox(t, append(append([]string{"new"}, append(smallBox, extra...)...), n)...)
	return getBox(t, n)
}

// box is an element of `kvbox ls --json`.
type box struct {
	Name        string `json:"name"`
	State       string `json:"state"`
	IP          string `json:"ip"`
	Gateway     string `json:"gateway"`
	Group       string `json:"group"`
	Bridge      string `json:"bridge"`
	MAC         string `json:"mac"`
	Image       string `json:"image"`
	Snapshot    string `json:"snapshot"`
	CPUs        int    `json:"cpus"`
	MemoryBytes int64  `json:"memory_bytes"`
	DiskBytes   int64  `json:"disk_bytes"`
	Dir         string `json:"dir"`
	Transport   string `json:"transport"`
	Tap         string `json:"tap"`
	UUID        string `json:"uuid"`
}

func listBoxes(t testing.TB) []box {
	t.Helper()
	var bs []box
	if err := json.Unmarshal([]byte(mustKvbox(t, "ls", "--json")), &bs); err != nil {
		t.Fatalf("kvbox ls --json: %v", err)
	}
	return bs
}

func getBox(t testing.TB, n string) box {
	t.Helper()
	for _, b := range listBoxes(t) {
		if b.Name == n {
			return b
		}
	}
	t.Fatalf("box %s is not in kvbox ls", n)
	return box{}
}

// inBox runs a shell command in a box and returns its stdout.
func inBox(t testing.TB, n, script string) string {
	t.Helper()
	return mustKvbox(t, "exec", n, "--", "sh", "-c", script)
}

func virsh(args ...string) (string, error) {
	out, err := exec.Command("virsh", append([]string{"-c", "qemu:///system"}, args...)...).CombinedOutput()
	return string(out), err
}

// eventually polls f until it returns nil or the timeout passes.
func eventually(t testing.TB, timeout time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %v", timeout, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// parallel runs f(i) for i in [0,n) at the same time.
func parallel(n int, f func(i int)) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() { defer wg.Done(); f(i) }()
	}
	wg.Wait()
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// subnetPrefix is the first three octets and a dot of the boxes' subnet
// (KVBOX_SUBNET, as for the CLI, or kvbox's default 172.30.0.0/24): two
// test runs on their own bridges keep their addresses apart.
var subnetPrefix = func() string {
	s := envOr("KVBOX_SUBNET", "172.30.0.0/24")
	if i := strings.LastIndex(s, "."); i > 0 {
		return s[:i+1]
	}
	return s
}()

// handedOut holds the subnets freeSubnet gave this run's tests.
var handedOut = struct {
	sync.Mutex
	m map[netip.Prefix]bool
}{m: map[netip.Prefix]bool{}}

// freeSubnet returns a /24 of 172.31.128.0/17 that no route of the test
// namespace overlaps and no other test of this run was given: a bridge
// left by a killed run, or another kvbox on this libvirtd, keeps its
// subnet, and a test's boxes stay reachable.
func freeSubnet(t testing.TB) string {
	t.Helper()
	routes, err := network.Routes()
	if err != nil {
		t.Fatal(err)
	}
	handedOut.Lock()
	defer handedOut.Unlock()
	for i := 128; i < 256; i++ {
		p := netip.PrefixFrom(netip.AddrFrom4([4]byte{172, 31, byte(i), 0}), 24)
		free := !handedOut.m[p]
		for _, r := range routes {
			free = free && !r.Prefix.Overlaps(p)
		}
		if free {
			handedOut.m[p] = true
			return p.String()
		}
	}
	t.Fatal("no free /24 in 172.31.128.0/17 for a test network")
	return ""
}

// groupKey is what names group's network on the host for the tests'
// state dir (domain.Host.groupKey): the group's name in the default state
// dir, the name with the state dir in another, whose groups are networks
// of their own.
func groupKey(group string) string {
	if filepath.Clean(stateDir) == statedir.Default {
		return group
	}
	return group + "@" + filepath.Clean(stateDir)
}

// groupBridge is the bridge of group in the tests' state dir.
func groupBridge(group string) string { return network.GroupBridge(groupKey(group)) }

// stateDir is the kvbox state directory the tests' kvbox uses:
// KVBOX_STATE_DIR, as for the CLI, so that two test runs can keep apart.
var stateDir = func() string {
	if d := os.Getenv("KVBOX_STATE_DIR"); d != "" {
		return d
	}
	return "/var/lib/kvbox"
}()
