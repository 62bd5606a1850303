//go:build e2e

package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// stoppedAt waits until process pid has stopped itself (a KVBOX_TEST_STOP_AT
// point).
func stoppedAt(t *testing.T, cmd *exec.Cmd, point string) {
	t.Helper()
	eventually(t, 60*time.Second, func() error {
		st, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/stat")
		if err != nil {
			return err
		}
		if f := strings.Fields(string(st[strings.LastIndexByte(string(st), ')')+1:])); len(f) > 0 && f[0] == "T" {
			return nil
		}
		return fmt.Errorf("kvbox did not stop at %s: %s", point, st)
	})
}

// TestTTLNameReused: a TTL removes the box that expired, never the box that
// took its name since. A command's sweep that found the expired box is held
// just before it removes it (KVBOX_TEST_STOP_AT=sweep-expired-box), the box
// goes meanwhile and a new box is made under its name; let go, the sweep
// leaves the new box alone.
func TestTTLNameReused(t *testing.T) {
	n := name(t, "reused")
	old := newBox(t, n, "--ttl", "1h")
	// The deadline passes with no reaper (as after a reboot). The held
	// command starts right after it: another kvbox's sweep would remove
	// the box first.
	mustKvbox(t, "ttl", n, "1s")
	for _, pid := range reapers("box", n) {
		exec.Command("kill", "-9", pid).Run()
	}
	time.Sleep(1100 * time.Millisecond)

	held := exec.Command(kvboxBin, "ls")
	held.Env = append(os.Environ(), "KVBOX_TEST_STOP_AT=sweep-expired-box")
	var out strings.Builder
	held.Stdout, held.Stderr = &out, &out
	if err := held.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		held.Process.Signal(syscall.SIGCONT)
		held.Wait()
	}()
	stoppedAt(t, held, "sweep-expired-box")

	// Meanwhile the expired box goes (this rm's own sweep may take it
	// first), and a new box takes its name.
	if r := kvbox(t, "rm", "--force", n); r.code != 0 && r.code != 3 {
		t.Fatalf("rm of the expired box: %s", r)
	}
	reused := newBox(t, n)
	if reused.UUID == old.UUID {
		t.Fatalf("the new box has the old one's UUID %s", old.UUID)
	}

	held.Process.Signal(syscall.SIGCONT)
	held.Wait()
	t.Logf("the held kvbox ls said: %s", out.String())
	if !domains(t)[n] {
		t.Fatalf("the sweep that found the expired box removed the new box of its name:\n%s", out.String())
	}
	if b := getBox(t, n); b.UUID != reused.UUID || b.State != "running" {
		t.Errorf("box %s is %s %s, want the new box %s running", n, b.UUID, b.State, reused.UUID)
	}
	mustKvbox(t, "exec", n, "--", "true")
}
