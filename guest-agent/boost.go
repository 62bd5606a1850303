package agent

import (
	"os"
	"runtime"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// boostNice is the nice value of the agent's threads while it re-identifies
// a clone. A clone's other processes react to what re-identification
// changes (journald to the kernel's message about the VM fork, systemd and
// through D-Bus logind to the clock step) on the same vCPUs, all of it on
// cold code under emulation; at -20 the scheduler gives the agent's
// threads nearly all the CPU they ask for while they compete.
const boostNice = -20

// boost sets every thread of the agent to boostNice, and returns what puts
// each back as it was (a thread made meanwhile gets the main thread's),
// and the calling thread's nice value before. Best effort: a thread that
// cannot be changed is left alone.
func boost() (restore func(), base int) {
	p, err := unix.Getpriority(unix.PRIO_PROCESS, 0) // the raw call returns 20-nice
	if err == nil {
		base = 20 - p
	}
	if err == nil && unix.Getpgrp() == os.Getpid() {
		// The agent leads its process group, as a systemd service does,
		// and runs its commands in groups of their own (exec.go,
		// hooks.go): one call sets every thread of the group. Reading
		// /proc/self/task and setting thread by thread was two system
		// calls per thread on cold code in a clone.
		if unix.Setpriority(unix.PRIO_PGRP, 0, boostNice) == nil {
			return func() { unix.Setpriority(unix.PRIO_PGRP, 0, base) }, base
		}
	}
	was := map[int]int{}
	for _, tid := range threads() {
		p, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
		if err != nil {
			continue
		}
		if unix.Setpriority(unix.PRIO_PROCESS, tid, boostNice) == nil {
			was[tid] = 20 - p
		}
	}
	return func() {
		main, ok := was[os.Getpid()]
		if !ok {
			return
		}
		for _, tid := range threads() {
			nice, ok := was[tid]
			if !ok {
				nice = main
			}
			unix.Setpriority(unix.PRIO_PROCESS, tid, nice)
		}
	}, base
}

// threads lists the agent's thread IDs.
func threads() []int {
	ents, _ := os.ReadDir("/proc/self/task")
	var tids []int
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids
}

// boosts counts the identities being applied. The first to start boosts
// the agent; the last to end sets it back. Two may overlap (a host that
// retried its first contact), and a second boost taken inside the first
// would take boostNice for the value to go back to: the agent, and every
// command it starts after, would stay at -20.
type boosts struct {
	mu      sync.Mutex
	n       int
	restore func()
	base    int // the nice value the agent had before the first boost
}

// start boosts the agent unless it is already, and returns what ends this
// boost (once; later calls do nothing).
func (b *boosts) start() (end func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.n == 0 {
		b.restore, b.base = boost()
	}
	b.n++
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			defer b.mu.Unlock()
			if b.n--; b.n == 0 {
				b.restore()
				b.restore = nil
			}
		})
	}
}

// unboosted runs start, which starts a process, from a thread at the
// agent's own nice value and the timer slack it started with: a process
// takes both from the thread that forks it, and a command must run neither
// at boostNice nor at the agent's slack (SetTimerSlack). (The host asks
// for a clone's after-clone hooks as soon as the identity's answer comes,
// which is sent before the boost ends.) No boost starts or ends meanwhile.
func (b *boosts) unboosted(start func() error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	runtime.LockOSThread() // Go forks on the calling goroutine's thread
	defer runtime.UnlockOSThread()
	if b.n > 0 {
		unix.Setpriority(unix.PRIO_PROCESS, 0, b.base)
		defer unix.Setpriority(unix.PRIO_PROCESS, 0, boostNice)
	}
	return withChildSlack(start)
}
