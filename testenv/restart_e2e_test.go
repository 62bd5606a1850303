//go:build e2e

package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// libvirtdPID is the pid of the libvirtd in this namespace.
func libvirtdPID(t testing.TB) int {
	t.Helper()
	b, err := os.ReadFile("/run/libvirtd.pid")
	if err != nil {
		t.Fatalf("libvirtd pid file: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || syscall.Kill(pid, 0) != nil {
		t.Fatalf("libvirtd pid %q is not running: %v", b, err)
	}
	return pid
}

// restartLibvirtd stops this namespace's libvirtd as a service manager
// would (SIGTERM, then wait for it to exit) and starts it again as
// testenv/setup.sh does. Running domains survive it.
func restartLibvirtd(t testing.TB) {
	t.Helper()
	pid := libvirtdPID(t)
	syscall.Kill(pid, syscall.SIGTERM)
	gone := false
	for range 900 { // libvirtd here takes up to ~35 s to exit
		if syscall.Kill(pid, 0) != nil {
			gone = true
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !gone {
		t.Fatalf("libvirtd (pid %d) did not exit within 90 s of SIGTERM", pid)
	}
	// No pipes: the daemon's children must not hold the test's output open.
	if err := exec.Command("./libvirtd.sh").Run(); err != nil {
		t.Fatalf("start libvirtd again: %v", err)
	}
	eventually(t, 60*time.Second, func() error {
		out, err := virsh("version")
		if err != nil {
			return fmt.Errorf("libvirtd does not answer yet: %v %s", err, out)
		}
		return nil
	})
}

// waitStopped waits until process pid is stopped (SIGSTOP).
func waitStopped(t testing.TB, pid int) {
	t.Helper()
	eventually(t, 2*time.Minute, func() error {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return err
		}
		f := strings.Fields(string(b)[strings.LastIndex(string(b), ")")+2:])
		if len(f) == 0 || f[0] != "T" {
			return fmt.Errorf("kvbox is not stopped yet (state %v)", f[:1])
		}
		return nil
	})
}

// TestSnapshotSurvivesLibvirtdRestart: libvirtd restarts while kvbox copies
// a clone's memory live (kvbox held at that point with KVBOX_TEST_STOP_AT).
// The command fails, its undo cannot reach QEMU, so it keeps the partial
// folder; the next kvbox command repairs the clone: running, its counter
// going on, no migration, capability, parameter, job or node left, no
// half snapshot listed or left on disk. Snapshots then work again.
func TestSnapshotSurvivesLibvirtdRestart(t *testing.T) {
	src, snap, c, sn := name(t, "rsrc"), name(t, "rwarm"), name(t, "rcl"), name(t, "rsnap")
	newBox(t, src)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)
	if r := newClone(t, snap, c); r.code != 0 {
		t.Fatalf("clone: %s", r)
	}
	startCounter(t, c)

	cmd := exec.Command(kvboxBin, "snapshots", "new", c, sn)
	cmd.Env = append(os.Environ(), "KVBOX_TEST_STOP_AT=live-copying")
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	waitStopped(t, cmd.Process.Pid)
	restartLibvirtd(t)
	cmd.Process.Signal(syscall.SIGCONT)
	err := cmd.Wait()
	t.Logf("kvbox snapshots new across a libvirtd restart: %v: %s", err, strings.TrimSpace(out.String()))
	if err == nil {
		t.Fatalf("the snapshot succeeded though libvirtd restarted under it")
	}
	partial := filepath.Join(stateDir, "snapshots", "."+sn+".partial")
	if _, err := os.Stat(filepath.Join(partial, "partial.json")); err != nil {
		t.Errorf("the failed command did not keep its record for recovery: %v", err)
	}

	// The next command (any) recovers.
	for _, s := range listSnapshots(t) {
		if s.Name == sn {
			t.Errorf("half snapshot %s listed", sn)
		}
	}
	if _, err := os.Stat(partial); !os.IsNotExist(err) {
		t.Errorf("partial folder left after recovery: %v", err)
	}
	if st := getBox(t, c).State; st != "running" {
		t.Fatalf("clone is %s after recovery", st)
	}
	assertDomainClean(t, c)
	assertCounting(t, c)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", sn+"-after") })
	newSnapshot(t, c, sn+"-after")
}
