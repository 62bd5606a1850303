package step

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
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
