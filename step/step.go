// Package step runs a multi-step host change as a list of named steps.
//
// A step has a name, a function and optionally an undo. The runner times
// every step, offers end-to-end tests a kill point under the step's own name
// (KVBOX_TEST_KILL_AT=name kills the process right after the step, to prove
// a crash there loses nothing), and on failure undoes the steps that ran,
// newest first. The timings it returns are what -v and make bench print.
//
// An operation is a Plan, so a variant of it is an edit of the list: a
// clone is the box-creation plan with its boot steps replaced.
//
//	p := step.Plan{
//		{Name: "reserve", Do: reserve, Undo: release},
//		{Name: "define", Do: define, Undo: undefine},
//		{Name: "start", Do: start},
//	}
//	timings, err := p.Run(ctx)
package step

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"

	"kvbox.dev/kvbox/revert"
)

// Step is one named part of an operation.
type Step struct {
	Name string
	// Do makes the change. An error stops the plan and undoes what ran.
	Do func(ctx context.Context) error
	// Undo, if set, takes the change back when a later step fails.
	Undo func()
}

// Plan is an ordered list of steps.
type Plan []Step

// Timing is how long one step took.
type Timing struct {
	Name     string
	Duration time.Duration
}

// Timings are the steps of one run, in order.
type Timings []Timing

// Get returns the time of the named step (0 if it did not run).
func (ts Timings) Get(name string) time.Duration {
	for _, t := range ts {
		if t.Name == name {
			return t.Duration
		}
	}
	return 0
}

// Between sums the steps from first to last, both included, in run order.
func (ts Timings) Between(first, last string) time.Duration {
	var d time.Duration
	in := false
	for _, t := range ts {
		if t.Name == first {
			in = true
		}
		if in {
			d += t.Duration
		}
		if t.Name == last && in {
			break
		}
	}
	return d
}

// Total sums every step.
func (ts Timings) Total() time.Duration {
	var d time.Duration
	for _, t := range ts {
		d += t.Duration
	}
	return d
}

// String reads "reserve 2ms, define 31ms, start 140ms".
func (ts Timings) String() string {
	parts := make([]string, len(ts))
	for i, t := range ts {
		parts[i] = fmt.Sprintf("%s %s", t.Name, t.Duration.Round(time.Millisecond))
	}
	return strings.Join(parts, ", ")
}

// Replace returns a copy of the plan with the step called name replaced by
// steps (none removes it). It panics if the plan has no such step: a plan
// edit that matches nothing is a programming error.
func (p Plan) Replace(name string, steps ...Step) Plan {
	for i, s := range p {
		if s.Name == name {
			out := make(Plan, 0, len(p)-1+len(steps))
			out = append(out, p[:i]...)
			out = append(out, steps...)
			return append(out, p[i+1:]...)
		}
	}
	panic("step: plan has no step " + name)
}

// Names lists the plan's step names in order.
func (p Plan) Names() []string {
	names := make([]string, len(p))
	for i, s := range p {
		names[i] = s.Name
	}
	return names
}

// Run runs the plan. On failure it undoes the steps that ran, newest first,
// and returns the error of the failed step, annotated with nothing: the
// step's own error says what went wrong. The timings include the failed step.
func (p Plan) Run(ctx context.Context) (Timings, error) {
	r := revert.New()
	defer r.Fail()
	ts, err := p.RunKeep(ctx, r)
	if err != nil {
		return ts, err
	}
	r.Success()
	return ts, nil
}

// RunKeep runs the plan adding each step's undo to r, and leaves r to the
// caller: the caller decides when the whole change has succeeded. On
// failure it does not undo anything itself.
func (p Plan) RunKeep(ctx context.Context, r *revert.Reverter) (Timings, error) {
	ts := make(Timings, 0, len(p))
	for _, s := range p {
		if err := ctx.Err(); err != nil {
			return ts, err
		}
		start := time.Now()
		err := s.Do(ctx)
		ts = append(ts, Timing{s.Name, time.Since(start)})
		if err != nil {
			return ts, err
		}
		if s.Undo != nil {
			r.Add(s.Undo)
		}
		KillPoint(s.Name)
	}
	return ts, nil
}

// KillEnv names the environment variable that makes KillPoint kill kvbox.
const KillEnv = "KVBOX_TEST_KILL_AT"

// StopEnv names the environment variable that makes KillPoint stop kvbox
// (SIGSTOP) instead: a test can then change the world under it (restart
// libvirtd) and let it go on with SIGCONT.
const StopEnv = "KVBOX_TEST_STOP_AT"

// KillPoint kills this process with SIGKILL when KVBOX_TEST_KILL_AT names
// point, and stops it when KVBOX_TEST_STOP_AT does. Plans call it after each
// step; code outside a plan may call it for points inside a step.
func KillPoint(point string) {
	if os.Getenv(KillEnv) == point {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
	}
	if os.Getenv(StopEnv) == point {
		os.Unsetenv(StopEnv) // once: a point inside a loop is passed again
		syscall.Kill(os.Getpid(), syscall.SIGSTOP)
	}
}

// After returns a copy of the plan with steps inserted after the step called
// name. It panics if the plan has no such step.
func (p Plan) After(name string, steps ...Step) Plan {
	for i, s := range p {
		if s.Name == name {
			out := make(Plan, 0, len(p)+len(steps))
			out = append(out, p[:i+1]...)
			out = append(out, steps...)
			return append(out, p[i+1:]...)
		}
	}
	panic("step: plan has no step " + name)
}

// Names lists the steps that ran, in order.
func (ts Timings) Names() []string {
	names := make([]string, len(ts))
	for i, t := range ts {
		names[i] = t.Name
	}
	return names
}
