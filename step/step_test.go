package step

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"kvbox.dev/kvbox/revert"
)

func recorder(log *[]string, name string, fail bool) Step {
	return Step{
		Name: name,
		Do: func(context.Context) error {
			*log = append(*log, "do "+name)
			if fail {
				return errors.New(name + " broke")
			}
			return nil
		},
		Undo: func() { *log = append(*log, "undo "+name) },
	}
}

func TestRunUndoesNewestFirstOnFailure(t *testing.T) {
	var log []string
	p := Plan{recorder(&log, "a", false), recorder(&log, "b", false), recorder(&log, "c", true)}
	ts, err := p.Run(context.Background())
	if err == nil || err.Error() != "c broke" {
		t.Fatalf("err = %v, want the failed step's own error", err)
	}
	want := []string{"do a", "do b", "do c", "undo b", "undo a"}
	if !slices.Equal(log, want) {
		t.Fatalf("log = %v, want %v", log, want)
	}
	if len(ts) != 3 || ts[2].Name != "c" {
		t.Fatalf("timings = %v, want a, b and the failed c", ts)
	}
}

func TestRunKeepsEverythingOnSuccess(t *testing.T) {
	var log []string
	p := Plan{recorder(&log, "a", false), {Name: "b", Do: func(context.Context) error {
		time.Sleep(5 * time.Millisecond)
		return nil
	}}}
	ts, err := p.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(log, []string{"do a"}) {
		t.Fatalf("log = %v", log)
	}
	if ts.Get("b") < 5*time.Millisecond || ts.Total() < ts.Get("b") {
		t.Fatalf("timings %v do not measure b", ts)
	}
}

func TestRunKeepLeavesUndoToCaller(t *testing.T) {
	var log []string
	r := revert.New()
	if _, err := (Plan{recorder(&log, "a", false), recorder(&log, "b", true)}).RunKeep(context.Background(), r); err == nil {
		t.Fatal("no error from a failing step")
	}
	if !slices.Equal(log, []string{"do a", "do b"}) {
		t.Fatalf("RunKeep undid by itself: %v", log)
	}
	r.Fail()
	if log[len(log)-1] != "undo a" {
		t.Fatalf("caller's Fail did not undo a: %v", log)
	}
}

func TestRunStopsOnCancelledContext(t *testing.T) {
	var log []string
	ctx, cancel := context.WithCancel(context.Background())
	p := Plan{{Name: "a", Do: func(context.Context) error { cancel(); return nil }, Undo: func() { log = append(log, "undo a") }},
		recorder(&log, "b", false)}
	if _, err := p.Run(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if !slices.Equal(log, []string{"undo a"}) {
		t.Fatalf("log = %v, want b skipped and a undone", log)
	}
}

func TestReplaceEditsACopy(t *testing.T) {
	var log []string
	p := Plan{recorder(&log, "a", false), recorder(&log, "boot", false), recorder(&log, "c", false)}
	q := p.Replace("boot", recorder(&log, "restore", false), recorder(&log, "resume", false))
	if got := q.Names(); !slices.Equal(got, []string{"a", "restore", "resume", "c"}) {
		t.Fatalf("replaced = %v", got)
	}
	if got := p.Names(); !slices.Equal(got, []string{"a", "boot", "c"}) {
		t.Fatalf("original changed: %v", got)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("Replace of a missing step did not panic")
		}
	}()
	p.Replace("nope")
}

func TestBetween(t *testing.T) {
	ts := Timings{{"a", 1}, {"pause", 2}, {"save", 4}, {"resume", 8}, {"z", 16}}
	if got := ts.Between("pause", "resume"); got != 14 {
		t.Fatalf("Between = %d, want 14", got)
	}
}

// The kill point really kills: a child test process run with
// KVBOX_TEST_KILL_AT=b dies by SIGKILL right after step b.
func TestKillPointKills(t *testing.T) {
	if os.Getenv("STEP_TEST_CHILD") == "1" {
		var log []string
		(Plan{recorder(&log, "a", false), recorder(&log, "b", false)}).Run(context.Background())
		os.Exit(0) // not reached when the kill point works
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestKillPointKills$")
	cmd.Env = append(os.Environ(), "STEP_TEST_CHILD=1", KillEnv+"=b")
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != -1 {
		t.Fatalf("child ended with %v, want killed by a signal", err)
	}
}

func TestAfterInsertsIntoACopy(t *testing.T) {
	var log []string
	p := Plan{recorder(&log, "a", false), recorder(&log, "b", false)}
	q := p.After("a", recorder(&log, "x", false), recorder(&log, "y", false))
	if got := q.Names(); !slices.Equal(got, []string{"a", "x", "y", "b"}) {
		t.Fatalf("After = %v", got)
	}
	if got := p.Names(); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("the original changed: %v", got)
	}
	ts, err := q.Run(context.Background())
	if err != nil || !slices.Equal(ts.Names(), []string{"a", "x", "y", "b"}) {
		t.Fatalf("Run = %v, %v", ts.Names(), err)
	}
	defer func() {
		if recover() == nil {
			t.Errorf("After of a missing step did not panic")
		}
	}()
	p.After("missing")
}

// hangGuard fails the test instead of hanging it when ch never closes: a
// step meant to run beside the plan that ran in line would wait forever.
var hangAfter = 10 * time.Second

func hangGuard(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(hangAfter):
		t.Fatalf("%s never happened: the steps did not overlap", what)
	}
}

func TestBesideRunsWhileThePlanGoesOn(t *testing.T) {
	bDone, aDone := make(chan struct{}), make(chan struct{})
	var aSawB, cSawA bool
	p := Plan{
		{Name: "a", Beside: true, Do: func(context.Context) error {
			hangGuard(t, bDone, "step b, after a in the plan,")
			aSawB = true
			time.Sleep(5 * time.Millisecond)
			close(aDone)
			return nil
		}},
		{Name: "b", Do: func(context.Context) error { close(bDone); return nil }},
		{Name: "c", Needs: []string{"a"}, Do: func(context.Context) error {
			select {
			case <-aDone:
				cSawA = true
			default:
			}
			return nil
		}},
	}
	ts, err := p.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !aSawB || !cSawA {
		t.Fatalf("a ran beside b: %v; c waited for a: %v", aSawB, cSawA)
	}
	if !slices.Equal(ts.Names(), []string{"b", "a", "c"}) || ts.Get("a") < 5*time.Millisecond || ts.Get("c") < ts.Get("a")-time.Millisecond {
		t.Fatalf("timings %v: want b, a (when c waited for it) and c, c's including its wait", ts)
	}
}

func TestBesideFailureFailsTheStepThatNeedsIt(t *testing.T) {
	var log []string
	p := Plan{
		recorder(&log, "first", false),
		{Name: "a", Beside: true, Do: func(context.Context) error { return errors.New("a broke") }},
		{Name: "b", Needs: []string{"a"}, Do: func(context.Context) error { log = append(log, "do b"); return nil }},
	}
	ts, err := p.Run(context.Background())
	if err == nil || err.Error() != "a broke" {
		t.Fatalf("err = %v, want the step beside's own error", err)
	}
	if !slices.Equal(log, []string{"do first", "undo first"}) {
		t.Fatalf("log = %v: b must not run, first must be undone", log)
	}
	if !slices.Contains(ts.Names(), "a") {
		t.Fatalf("timings %v lack the failed step beside", ts)
	}
}

func TestFailureWaitsForStepsBeside(t *testing.T) {
	release := make(chan struct{})
	var ended bool
	var undoSawEnd bool
	p := Plan{
		{Name: "first", Do: func(context.Context) error { return nil }, Undo: func() { undoSawEnd = ended }},
		{Name: "a", Beside: true, Do: func(context.Context) error {
			hangGuard(t, release, "step b, after a in the plan,")
			time.Sleep(20 * time.Millisecond)
			ended = true
			return nil
		}},
		{Name: "b", Do: func(context.Context) error { close(release); return errors.New("b broke") }},
	}
	if _, err := p.Run(context.Background()); err == nil {
		t.Fatal("no error from a failing step")
	}
	if !ended || !undoSawEnd {
		t.Fatalf("the plan returned (ended %v) or undid (after the end: %v) before the step beside it ended", ended, undoSawEnd)
	}
}

func TestBesideAtTheEndIsWaitedFor(t *testing.T) {
	p := Plan{{Name: "a", Beside: true, Do: func(context.Context) error { return errors.New("a broke") }}}
	ts, err := p.Run(context.Background())
	if err == nil || !slices.Equal(ts.Names(), []string{"a"}) {
		t.Fatalf("err %v, timings %v: a plan ends with the steps beside it", err, ts)
	}
}

func TestBesideMisuseIsAProgrammingError(t *testing.T) {
	for name, p := range map[string]Plan{
		"beside with an undo": {{Name: "a", Beside: true, Do: func(context.Context) error { return nil }, Undo: func() {}}},
		"needs no such step":  {{Name: "a", Needs: []string{"x"}, Do: func(context.Context) error { return nil }}},
		"needs a step in line": {
			{Name: "x", Do: func(context.Context) error { return nil }},
			{Name: "a", Needs: []string{"x"}, Do: func(context.Context) error { return nil }},
		},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			p.Run(context.Background())
		}()
	}
}

func TestTogetherRunsAtOnce(t *testing.T) {
	aUp, bUp := make(chan struct{}), make(chan struct{})
	err := Together(
		func(context.Context) error { close(aUp); hangGuard(t, bUp, "b"); return errors.New("a broke") },
		func(context.Context) error { close(bUp); hangGuard(t, aUp, "a"); return errors.New("b broke") },
	)(context.Background())
	if err == nil || !strings.Contains(err.Error(), "a broke") || !strings.Contains(err.Error(), "b broke") {
		t.Fatalf("err = %v, want both errors", err)
	}
}
