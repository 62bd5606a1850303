package agent

import (
	"os"
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

func needRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("lowering a nice value needs root (CAP_SYS_NICE); the agent runs as root")
	}
}

// wantNice fails t for every thread of the process whose nice value is
// not want.
func wantNice(t *testing.T, want int, when string) {
	t.Helper()
	for _, tid := range threads() {
		if n := niceOf(t, tid); n != want {
			t.Errorf("%s: thread %d has nice %d, want %d", when, tid, n, want)
		}
	}
}

func niceOf(t *testing.T, tid int) int {
	p, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		t.Fatal(err)
	}
	return 20 - p
}

// boost sets every thread to boostNice, and its restore puts each back.
func TestBoost(t *testing.T) {
	needRoot(t)
	before := niceOf(t, os.Getpid())
	restore, base := boost()
	if base != before {
		t.Errorf("boost says the nice value was %d, want %d", base, before)
	}
	wantNice(t, boostNice, "while boosted")
	restore()
	wantNice(t, before, "after the boost")
}

// In a process that leads its group, as the agent under systemd, boost
// sets the group at once; the test runs that in a child of its own group.
func TestBoostGroup(t *testing.T) {
	needRoot(t)
	if os.Getenv("KVBOX_TEST_BOOST_GROUP") == "1" {
		if unix.Getpgrp() != os.Getpid() {
			t.Fatal("the child does not lead its group")
		}
		TestBoost(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBoostGroup$", "-test.v")
	cmd.Env = append(os.Environ(), "KVBOX_TEST_BOOST_GROUP=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

// Overlapping boosts (two identities at once) set the threads back to
// where they were when the last one ends, in either order.
func TestBoostsOverlap(t *testing.T) {
	needRoot(t)
	before := niceOf(t, os.Getpid())
	var b boosts
	for _, firstEndsFirst := range []bool{true, false} {
		end1 := b.start()
		end2 := b.start()
		if firstEndsFirst {
			end1()
			end1() // a second call does nothing
		} else {
			end2()
		}
		if n := niceOf(t, os.Getpid()); n != boostNice {
			t.Errorf("one of two boosts ended: nice %d, want %d", n, boostNice)
		}
		if firstEndsFirst {
			end2()
		} else {
			end1()
		}
		wantNice(t, before, "both boosts ended")
	}
}

// A process started while the agent is boosted is forked from a thread at
// the agent's own nice value; the agent stays boosted.
func TestUnboostedForksAtTheAgentsNice(t *testing.T) {
	needRoot(t)
	before := niceOf(t, os.Getpid())
	var b boosts
	end := b.start()
	forkedAt := 99
	b.unboosted(func() error {
		p, _ := unix.Getpriority(unix.PRIO_PROCESS, 0) // this thread: 20-nice
		forkedAt = 20 - p
		return nil
	})
	if forkedAt != before {
		t.Errorf("forked at nice %d, want %d", forkedAt, before)
	}
	if n := niceOf(t, os.Getpid()); n != boostNice {
		t.Errorf("after the fork the agent has nice %d, want %d", n, boostNice)
	}
	end()
	wantNice(t, before, "after the boost")
}
