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
// Work that overlaps is said in the plan, never hidden in a step: a step
// Beside runs in a goroutine of its own while the plan goes on, and a
// later step that Needs it waits for its end; Together runs the parts of
// one step at once.
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
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
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
	// Beside runs Do in a goroutine of its own: the plan goes on with the
	// next step at once. A step beside has no Undo (what it makes, the
	// undo of an earlier step takes back); its kill point is its end.
	Beside bool
	// Needs names steps before this one that run Beside: it starts once
	// they have ended, and the plan fails with the first of their errors.
	// Its time includes the wait.
	Needs []string
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
// failure it does not undo anything itself. It returns once every step
// that ran beside the others has ended, so that an undo never races one.
func (p Plan) RunKeep(ctx context.Context, r *revert.Reverter) (Timings, error) {
	rn := &run{ts: make(Timings, 0, len(p)), beside: map[string]*besideStep{}}
	for _, s := range p {
		if err := rn.step(ctx, s, r); err != nil {
			rn.waitAll()
			return rn.ts, err
		}
	}
	if err := rn.waitAll(); err != nil {
		return rn.ts, err
	}
	return rn.ts, nil
}

// run is a plan being run: its timings, and the steps running beside it.
type run struct {
	ts     Timings
	beside map[string]*besideStep
	order  []string // the steps beside, in the order they started
}

// besideStep is a step running Beside: done closes when it has ended.
type besideStep struct {
	done   chan struct{}
	err    error
	took   time.Duration
	joined bool
}

func (rn *run) step(ctx context.Context, s Step, r *revert.Reverter) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if s.Beside {
		rn.start(ctx, s)
		return nil
	}
	start := time.Now()
	err := rn.wait(s.Needs...)
	if err == nil {
		err = s.Do(ctx)
	}
	rn.ts = append(rn.ts, Timing{s.Name, time.Since(start)})
	if err != nil {
		return err
	}
	if s.Undo != nil {
		r.Add(s.Undo)
	}
	KillPoint(s.Name)
	return nil
}

// start runs a step beside the plan.
func (rn *run) start(ctx context.Context, s Step) {
	if s.Undo != nil {
		panic("step: " + s.Name + " runs beside the plan and has an undo")
	}
	b := &besideStep{done: make(chan struct{})}
	rn.beside[s.Name] = b
	rn.order = append(rn.order, s.Name)
	needs := make([]*besideStep, len(s.Needs))
	for i, n := range s.Needs {
		needs[i] = rn.besideStep(n)
	}
	go func() {
		defer close(b.done)
		for _, n := range needs {
			if <-n.done; n.err != nil {
				b.err = n.err
				return
			}
		}
		start := time.Now()
		b.err = s.Do(ctx)
		b.took = time.Since(start)
		if b.err == nil {
			KillPoint(s.Name)
		}
	}()
}

func (rn *run) besideStep(name string) *besideStep {
	b, ok := rn.beside[name]
	if !ok {
		panic("step: no step " + name + " runs beside the plan before the step that needs it")
	}
	return b
}

// wait waits for the named steps beside the plan, records the time of
// each the first time it is waited for, and returns the first error.
func (rn *run) wait(names ...string) error {
	var first error
	for _, n := range names {
		b := rn.besideStep(n)
		<-b.done
		if !b.joined {
			b.joined = true
			rn.ts = append(rn.ts, Timing{n, b.took})
		}
		if first == nil {
			first = b.err
		}
	}
	return first
}

// waitAll waits for every step still running beside the plan.
func (rn *run) waitAll() error { return rn.wait(rn.order...) }

// Together is a step's Do that runs fs at once and returns once each has
// ended, with their errors joined: a step whose parts overlap says so in
// the plan.
func Together(fs ...func(context.Context) error) func(context.Context) error {
	return func(ctx context.Context) error {
		errs := make([]error, len(fs))
		var wg sync.WaitGroup
		for i, f := range fs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = f(ctx)
			}()
		}
		wg.Wait()
		return errors.Join(errs...)
	}
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
