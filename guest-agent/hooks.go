package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"
)

// After-clone hooks: executables in AfterCloneDir run, in name order, as
// root, after a clone was re-identified and before its network port opens,
// so applications can rotate tokens, drop connections of the source and
// reseed their own generators. A hook that fails (or outlives HookTimeout)
// fails the clone, which kvbox then removes.

// AfterCloneDir holds the hooks inside a box.
const AfterCloneDir = "/etc/kvbox/after-clone.d"

// HookTimeout bounds one hook: its process group is killed after it.
const HookTimeout = 30 * time.Second

// FeatureAfterClone: RunAfterCloneHooks.
const FeatureAfterClone = "after-clone-hooks"

// HooksHelperArg is argv[1] of the agent binary run as the hook runner.
const HooksHelperArg = "after-clone-hooks"

// FeatureHookCount: Info.AfterCloneHooks is reported, so a host can skip
// running the hook runner (an exec of this binary, slow under TCG) in
// a box that has no hooks.
const FeatureHookCount = "after-clone-hook-count"

func init() {
	registerFeature(FeatureAfterClone)
	registerFeature(FeatureHookCount)
	registerHelper(HooksHelperArg, runHooksHelper)
}

// hookCount is Info.AfterCloneHooks: how many hooks the runner would run,
// -1 when the folder cannot be read (the runner then says why).
func hookCount() int {
	names, err := hookNames(AfterCloneDir)
	if err != nil {
		return -1
	}
	return len(names)
}

// hookNames lists the hooks of dir to run: regular files (a symlink to
// one too) with an execute bit, not hidden, not editor backups, sorted.
func hookNames(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range ents {
		n := e.Name()
		if strings.HasPrefix(n, ".") || strings.HasSuffix(n, "~") || strings.HasSuffix(n, ".dpkg-old") {
			continue
		}
		st, err := os.Stat(filepath.Join(dir, n))
		if err != nil || !st.Mode().IsRegular() || st.Mode()&0o111 == 0 {
			continue
		}
		names = append(names, n)
	}
	sort.Strings(names)
	return names, nil
}

// runHooksHelper is the agent binary's main as the hook runner: every hook
// of dir in order, its output on stdout, one line on stderr and exit 1 at
// the first that fails.
func runHooksHelper(args []string) int {
	dir, timeout := AfterCloneDir, HookTimeout
	if len(args) > 0 {
		dir = args[0]
	}
	if len(args) > 1 {
		if d, err := time.ParseDuration(args[1]); err == nil && d > 0 {
			timeout = d
		}
	}
	names, err := hookNames(dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "after-clone hooks: %v\n", err)
		return 1
	}
	for _, n := range names {
		if err := runHook(filepath.Join(dir, n), timeout); err != nil {
			fmt.Fprintf(os.Stderr, "after-clone hook %s: %v\n", n, err)
			return 1
		}
	}
	fmt.Fprintf(os.Stderr, "ran %d\n", len(names))
	return 0
}

func runHook(path string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, path)
	cmd.Dir = "/"
	cmd.Env = append(DefaultEnv(false, ""), "KVBOX_HOOK=after-clone")
	cmd.Stdin = nil
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stdout
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = time.Second
	err := cmd.Run()
	if ctx.Err() != nil {
		return fmt.Errorf("timed out after %s (its process group was killed)", timeout)
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return fmt.Errorf("exit status %d", exitCode(ee.ProcessState, err))
	}
	return err
}

// HookError is a failed after-clone hook, with what it printed.
type HookError struct {
	Msg    string // "after-clone hook 10-x: exit status 3"
	Output string // its stdout and stderr, the last 16 KiB
}

func (e *HookError) Error() string {
	if e.Output == "" {
		return e.Msg
	}
	return e.Msg + "; its output:\n" + strings.TrimRight(e.Output, "\n")
}

// DefaultHooksDeadline is the host's own bound on a clone's after-clone
// hooks, all of them: HookTimeout per hook is the guest's word, and a
// snapshot's guest (or a hook's background child that keeps writing to the
// hooks' output, which an honest agent then keeps reading) may never end
// the run.
const DefaultHooksDeadline = 2 * time.Minute

// HooksDeadlineError is after-clone hooks that did not end within the
// host's deadline.
type HooksDeadlineError struct {
	After  time.Duration
	Output string // what the hooks printed, the last 16 KiB
}

func (e *HooksDeadlineError) Error() string {
	msg := fmt.Sprintf("after-clone hooks did not end within %s, kvbox's deadline for them all (the guest gives each %s)", e.After, HookTimeout)
	if e.Output == "" {
		return msg
	}
	return msg + "; their output:\n" + strings.TrimRight(e.Output, "\n")
}

// RunAfterCloneHooks runs the box's after-clone hooks, for at most
// deadline in all (0: DefaultHooksDeadline): past it the run is killed and
// a *HooksDeadlineError returned. ran is how many ran; an agent that
// predates them runs none (ran 0, no error): an image made for it has no
// hooks kvbox promised to run.
func (c *Client) RunAfterCloneHooks(ctx context.Context, deadline time.Duration) (ran int, err error) {
	if deadline <= 0 {
		deadline = DefaultHooksDeadline
	}
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	out := &tailBuffer{max: 16 << 10}
	defer func() {
		if err != nil && parent.Err() == nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			err = &HooksDeadlineError{After: deadline, Output: out.String()}
		}
	}()
	if err := c.require(ctx, "after-clone hooks", FeatureAfterClone); err != nil {
		if errors.Is(err, ErrTooOld) {
			return 0, nil
		}
		return 0, err
	}
	if c.hooksNone() {
		return 0, nil
	}
	ew := &helperStderr{}
	req := ExecRequest{Argv: []string{selfArgv0, HooksHelperArg}}
	code, err := c.Exec(ctx, req, nil, out, ew, nil)
	ew.flush()
	if err != nil {
		return 0, err
	}
	if code != 0 {
		msg := strings.TrimSpace(ew.last)
		if msg == "" {
			msg = fmt.Sprintf("after-clone hooks: exit status %d", code)
		}
		return 0, &HookError{Msg: msg, Output: out.String()}
	}
	fmt.Sscanf(ew.last, "ran %d", &ran)
	return ran, nil
}

// hooksNone reports whether the agent said it has no hooks to run.
func (c *Client) hooksNone() bool {
	c.infoOnce.Lock()
	defer c.infoOnce.Unlock()
	return c.info != nil && c.info.Has(FeatureHookCount) && c.info.AfterCloneHooks == 0
}

// tailBuffer keeps the last max bytes written.
type tailBuffer struct {
	bytes.Buffer
	max int
}

func (t *tailBuffer) Write(b []byte) (int, error) {
	n := len(b)
	t.Buffer.Write(b)
	if t.Len() > t.max {
		rest := t.Bytes()[t.Len()-t.max:]
		t.Reset()
		t.Buffer.Write(rest)
	}
	return n, nil
}

var _ io.Writer = (*tailBuffer)(nil)
