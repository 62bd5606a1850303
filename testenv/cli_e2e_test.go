//go:build e2e

package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"kvbox.dev/kvbox/domain"
)

// The rough edges of issue 14, on real boxes: rm of several names handles
// every one, exec keeps a sane environment and exit codes, a paused box is
// resumed by start, and a box whose agent ports are all taken exits 5.
func TestCLIRoughEdges(t *testing.T) {
	a, b := name(t, "cli-a"), name(t, "cli-b")
	ba := newBox(t, a)
	newBox(t, b)
	missing := name(t, "cli-missing")

	// Exit codes of the guest's command are kvbox's.
	if r := kvbox(t, "exec", a, "--", "sh", "-c", "exit 42"); r.code != 42 {
		t.Errorf("exec exit 42: %s", r)
	}
	// PATH and HOME are set for commands (exec -t sends the same defaults
	// plus TERM; a unit test checks that list).
	if out := inBox(t, a, `echo "$PATH|$HOME"`); !strings.Contains(out, "/usr/bin") || !strings.Contains(out, "|/root") {
		t.Errorf("exec environment: %q", out)
	}

	// exec -t (on a terminal: script(1) gives kvbox one) keeps PATH and
	// HOME and adds the caller's TERM.
	tty := exec.Command("script", "-qec", kvboxBin+" exec -t "+a+` -- sh -c 'echo "P=$PATH H=$HOME T=$TERM"'`, "/dev/null")
	tty.Env = append(os.Environ(), "TERM=xterm-kvboxtest")
	if out, err := tty.CombinedOutput(); err != nil || !strings.Contains(string(out), "/usr/bin") || !strings.Contains(string(out), "H=/root T=xterm-kvboxtest") {
		t.Errorf("exec -t environment: %v %q", err, out)
	}

	// Every agent port taken by another kvbox: exit 5 (busy), one line.
	var locks []*os.File
	for _, p := range domain.AgentSockets(ba.Dir) {
		f, err := os.OpenFile(p.Path+".lock", os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
			t.Fatal(err)
		}
		locks = append(locks, f)
	}
	r := kvbox(t, "exec", a, "--", "true")
	for _, f := range locks {
		f.Close()
	}
	if r.code != 5 || !strings.Contains(r.stderr, "every agent port is busy") || strings.Count(r.stderr, "\n") != 1 {
		t.Errorf("exec with every port taken: %s; want exit 5 and one line", r)
	}

	// A paused box: exec says how to resume it, start resumes it.
	if out, err := virsh("suspend", a); err != nil {
		t.Fatalf("virsh suspend: %v %s", err, out)
	}
	if r := kvbox(t, "exec", a, "--", "true"); r.code != 5 || !strings.Contains(r.stderr, "kvbox start "+a) {
		t.Errorf("exec of a paused box: %s", r)
	}
	mustKvbox(t, "start", a)
	if got := getBox(t, a).State; got != "running" {
		t.Errorf("after kvbox start of a paused box its state is %s", got)
	}
	if out := inBox(t, a, "echo alive"); strings.TrimSpace(out) != "alive" {
		t.Errorf("resumed box: %q", out)
	}

	// A kvbox waiting on a box's lock ends on Ctrl-C with exit 130 and
	// changes nothing.
	lock, err := os.OpenFile(filepath.Join(stateDir, "locks", a+".lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	waiting := exec.Command(kvboxBin, "stop", a)
	var waitErr strings.Builder
	waiting.Stderr = &waitErr
	if err := waiting.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	waiting.Process.Signal(os.Interrupt)
	err = waiting.Wait()
	lock.Close()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 130 {
		t.Errorf("kvbox stop waiting on the box lock, then SIGINT: %v, stderr %q; want exit 130", err, waitErr.String())
	}
	if got := getBox(t, a).State; got != "running" {
		t.Errorf("after an interrupted stop the box is %s", got)
	}

	// A hung agent: exec gives up after --dial-timeout with exit 6, one line.
	// The agent is stopped (SIGSTOP) from inside, a second after exec returns.
	inBox(t, a, `setsid sh -c 'sleep 1; kill -STOP $(pidof kvbox-agent)' </dev/null >/dev/null 2>&1 &`)
	time.Sleep(2 * time.Second)
	start := time.Now()
	r = kvbox(t, "--dial-timeout", "3s", "exec", a, "--", "true")
	if r.code != 6 || !strings.Contains(r.stderr, "did not answer within 3s") || strings.Count(r.stderr, "\n") != 1 {
		t.Errorf("exec of a box whose agent hangs: %s; want exit 6 and one line", r)
	}
	if took := time.Since(start); took > time.Minute {
		t.Errorf("exec with --dial-timeout 3s took %s", took)
	}

	// Error lines do not repeat themselves.
	r = kvbox(t, "exec", missing, "--", "true")
	if r.code != 3 || strings.HasSuffix(strings.TrimSpace(r.stderr), ": not found") {
		t.Errorf("exec of a missing box: %s", r)
	}

	// rm without --force of a missing name and a running box: both reported,
	// nothing removed, non-zero.
	r = kvbox(t, "rm", missing, b)
	if r.code == 0 || !strings.Contains(r.stderr, missing) || !strings.Contains(r.stderr, b) {
		t.Errorf("rm missing running: %s", r)
	}
	// rm --force of a missing name and two running boxes: quiet about the
	// missing one, removes both, exits 0.
	start = time.Now()
	r = kvbox(t, "rm", "--force", missing, a, b)
	took := time.Since(start)
	if r.code != 0 || r.stderr != "" {
		t.Errorf("rm --force missing a b: %s", r)
	}
	for _, bx := range listBoxes(t) {
		if bx.Name == a || bx.Name == b {
			t.Errorf("box %s is still there after rm --force", bx.Name)
		}
	}
	if _, err := os.Stat(filepath.Dir(ba.Dir)); err != nil {
		t.Errorf("the boxes folder went away: %v", err)
	}
	t.Logf("rm --force of two running boxes and a missing name: %s", took.Round(time.Millisecond))
}
