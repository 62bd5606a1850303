package agent

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func niceOf(t *testing.T, tid int) int {
	p, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		t.Fatal(err)
	}
	return 20 - p
}

// boost sets every thread to boostNice, and its restore puts each back.
func TestBoost(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("lowering a nice value needs root (CAP_SYS_NICE); the agent runs as root")
	}
	before := niceOf(t, os.Getpid())
	restore := boost()
	for _, tid := range threads() {
		if n := niceOf(t, tid); n != boostNice {
			t.Errorf("thread %d has nice %d while boosted, want %d", tid, n, boostNice)
		}
	}
	restore()
	for _, tid := range threads() {
		if n := niceOf(t, tid); n != before {
			t.Errorf("thread %d has nice %d after the boost, want %d", tid, n, before)
		}
	}
}
