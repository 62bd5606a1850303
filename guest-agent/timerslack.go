package agent

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// SetTimerSlack gives every thread of the agent a timer slack of d: a sleep
// of theirs may end up to d late, so that the kernel can wake them with
// other timers. Threads made later inherit it from the thread that makes
// them; a process the agent starts does not (boosts.unboosted).
//
// Under emulation this keeps Go's sysmon thread from waking every few tens
// of microseconds. sysmon sleeps 20 µs between its rounds for as long as it
// finds a thread in a system call to take the processor from, and under
// TCG nearly every system call outlasts that: in a clone's
// re-identification sysmon and the agent's working thread switched
// constantly, each switch a timer interrupt and two trips through the
// guest's scheduler, and a millisecond of slack cut them to a third
// (docs/design.md#the-agent-under-tcg). Nothing in the agent waits on a
// timer shorter than 10 ms.
func SetTimerSlack(d time.Duration) error {
	was, err := timerSlackOf(os.Getpid())
	if err != nil {
		return err
	}
	childSlack.Store(was)
	v := []byte(strconv.FormatInt(d.Nanoseconds(), 10))
	var errs []error
	for _, tid := range threads() {
		// A thread gone meanwhile does not matter.
		if err := os.WriteFile(timerSlackFile(tid), v, 0); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	agentSlack.Store(d.Nanoseconds())
	return errors.Join(errs...)
}

// timerSlackFile is where thread tid's timer slack is: /proc/TID has it,
// /proc/self/task/TID not.
func timerSlackFile(tid int) string { return "/proc/" + strconv.Itoa(tid) + "/timerslack_ns" }

// timerSlackOf reads thread tid's timer slack, in nanoseconds.
func timerSlackOf(tid int) (int64, error) {
	b, err := os.ReadFile(timerSlackFile(tid))
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// agentSlack is the timer slack SetTimerSlack gave the agent's threads (0:
// none), and childSlack the one the agent started with, which the
// processes it starts get.
var agentSlack, childSlack atomic.Int64

// withChildSlack runs start on the calling thread, which the caller has
// locked, at the timer slack the agent started with.
func withChildSlack(start func() error) error {
	if agentSlack.Load() == 0 {
		return start()
	}
	unix.Prctl(unix.PR_SET_TIMERSLACK, uintptr(childSlack.Load()), 0, 0, 0)
	defer unix.Prctl(unix.PR_SET_TIMERSLACK, uintptr(agentSlack.Load()), 0, 0, 0)
	return start()
}
