package kvbox

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/statedir"
)

// A reaper holds its lock while it lives, stopReaper signals only a
// process whose command line is that reaper's, and leaves no lock file.
func TestReaperLockAndStop(t *testing.T) {
	h := &Host{layout: statedir.Layout{Root: t.TempDir()}}
	lock := h.layout.ReaperLock(ReapBox, "dev")
	if h.reaperAlive(ReapBox, "dev") {
		t.Fatal("a reaper is alive before any ran")
	}
	os.MkdirAll(filepath.Dir(lock), 0o700)
	held, err := base.Lock(lock, false)
	if err != nil {
		t.Fatalf("the reaper's lock: %v", err)
	}
	held.Note(itoa(os.Getpid()) + "\n")
	if !h.reaperAlive(ReapBox, "dev") {
		t.Error("the reaper holding its lock is not alive")
	}
	if _, err := base.Lock(lock, false); !errors.Is(err, base.ErrLocked) {
		t.Errorf("a second reaper of the same box got the lock: %v", err)
	}
	// The holder is this test process: stopReaper must not kill it.
	h.stopReaper(ReapBox, "dev")
	held.Release()
	if _, err := os.Stat(lock); !os.IsNotExist(err) {
		t.Errorf("lock file left after release: %v", err)
	}

	// A process that is no reaper of this box is never signalled.
	sleep := exec.Command("sleep", "30")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	defer sleep.Process.Kill()
	if isReaper(sleep.Process.Pid, ReapBox, "dev") {
		t.Error("sleep taken for a reaper")
	}
	fake := exec.Command("sh", "-c", "sleep 30", ReaperArg, ReapBox, "dev")
	if err := fake.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { fake.Wait(); close(done) }()
	// Right after fork the child's command line is still the test's: wait
	// for the exec.
	for i := 0; i < 200 && !isReaper(fake.Process.Pid, ReapBox, "dev"); i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if !isReaper(fake.Process.Pid, ReapBox, "dev") || isReaper(fake.Process.Pid, ReapBox, "other") {
		t.Error("isReaper does not read the command line")
	}
	// Its lock, with its pid, as a reaper writes it: StopReaper kills it.
	l, err := base.Lock(lock, false)
	if err != nil {
		t.Fatal(err)
	}
	l.Note(itoa(fake.Process.Pid) + "\n")
	go func() { <-done; l.Unlock() }() // the lock dies with the process
	h.stopReaper(ReapBox, "dev")
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("stopReaper did not end the reaper")
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

// A reaper that ends leaves no zombie under the process that started it
// (kvbox serve starts one per sandbox and runs for days).
func TestReaperLeavesNoZombie(t *testing.T) {
	h := &Host{layout: statedir.Layout{Root: t.TempDir()}}
	h.cfg.ReaperCommand = func(kind, name, id string) *exec.Cmd {
		return exec.Command("true")
	}
	os.MkdirAll(h.layout.Box("dev"), 0o700)
	if err := h.startReaper(ReapBox, "dev", "uuid"); err != nil {
		t.Fatal(err)
	}
	// The child is the only one this test starts: find it among this
	// process's children, and wait until it is reaped (gone from the
	// list), not a zombie.
	for i := 0; ; i++ {
		pid := 0
		zombie := false
		for _, c := range childrenOf(t, os.Getpid()) {
			st, err := os.ReadFile("/proc/" + strconv.Itoa(c) + "/stat")
			if err == nil && strings.Contains(string(st), "(true) ") {
				pid = c
				zombie = strings.Contains(string(st), ") Z ")
			}
		}
		if pid == 0 {
			return
		}
		if i == 500 {
			t.Fatalf("the reaper (pid %d) ended and stays a child of this process (zombie: %v)", pid, zombie)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// childrenOf lists pid's child processes, from every thread's children.
func childrenOf(t *testing.T, pid int) []int {
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, task := range tasks {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + task.Name() + "/children")
		for _, f := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(f); err == nil {
				out = append(out, n)
			}
		}
	}
	return out
}
