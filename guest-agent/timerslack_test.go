package agent

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

func slackOf(t *testing.T, tid int) int64 {
	t.Helper()
	n, err := timerSlackOf(tid)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestTimerSlack: every thread of the agent gets the slack, and a process
// it starts, boosted or not, the slack it started with.
func TestTimerSlack(t *testing.T) {
	needRoot(t) // another thread's slack needs CAP_SYS_NICE
	was := slackOf(t, os.Getpid())
	const d = 3 * time.Millisecond
	if err := SetTimerSlack(d); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		SetTimerSlack(time.Duration(was))
		agentSlack.Store(0)
	})
	for _, tid := range threads() {
		if s := slackOf(t, tid); s != d.Nanoseconds() {
			t.Errorf("thread %d has slack %d ns, want %d", tid, s, d.Nanoseconds())
		}
	}
	child := func(b *boosts) int64 {
		cmd := exec.Command("cat", "/proc/self/timerslack_ns")
		var out strings.Builder
		cmd.Stdout = &out
		if err := b.unboosted(cmd.Start); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.ParseInt(strings.TrimSpace(out.String()), 10, 64)
		return n
	}
	var b boosts
	if s := child(&b); s != was {
		t.Errorf("a process the agent started has slack %d ns, want %d", s, was)
	}
	end := b.start()
	defer end()
	if s := child(&b); s != was {
		t.Errorf("a process the agent started during a boost has slack %d ns, want %d", s, was)
	}
	for _, tid := range threads() {
		if s := slackOf(t, tid); s != d.Nanoseconds() {
			t.Errorf("after starting processes, thread %d has slack %d ns, want %d", tid, s, d.Nanoseconds())
		}
	}
}
