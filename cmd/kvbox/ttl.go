package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/kvbox"
)

// parseTTL reads a --ttl or `kvbox ttl` duration: a Go duration (30s, 30m,
// 2h, 1h30m) or a number of days (3d); none clears it (ok false).
func parseTTL(s string) (d time.Duration, ok bool, err error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "none", "never", "off":
		return 0, false, nil
	}
	if n, found := strings.CutSuffix(s, "d"); found {
		var days int
		if _, err := fmt.Sscanf(n, "%d", &days); err == nil && fmt.Sprint(days) == n && days > 0 {
			return time.Duration(days) * 24 * time.Hour, true, nil
		}
	}
	d, err = time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, false, usage("TTL %q: give a positive duration like 20s, 30m, 2h or 3d, or none", s)
	}
	if d < time.Second {
		return 0, false, usage("TTL %q: give at least 1s", s)
	}
	return d, true, nil
}

// expiry is the deadline a TTL sets from now, nil for none.
func expiry(ttl string) (*time.Time, error) {
	d, ok, err := parseTTL(ttl)
	if err != nil || !ok {
		return nil, err
	}
	t := time.Now().Add(d)
	return &t, nil
}

// newExpiry is the deadline of a new box or snapshot (what) given --ttl
// (nil without the flag): none is refused, as it has none anyway.
func newExpiry(given bool, ttl, what string) (*time.Time, error) {
	if !given {
		return nil, nil
	}
	at, err := expiry(ttl)
	if err == nil && at == nil {
		return nil, usage("--ttl %s: a new %s has no TTL unless given one; leave --ttl out", ttl, what)
	}
	return at, err
}

// ttlLeft is the TTL column: the time left, "expired", or "-".
func ttlLeft(at *time.Time) string {
	if at == nil {
		return "-"
	}
	d := time.Until(*at)
	switch {
	case d <= 0:
		return "expired"
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()+0.5))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

func (a *app) newCmdTTL() *cobra.Command {
	return &cobra.Command{
		Use:   "ttl BOX DURATION|none",
		Short: "Set when a box removes itself (time from now), or clear it",
		Long: `Set a box's deadline to DURATION from now (20s, 30m, 2h, 3d), replacing any
earlier one, or clear it with none. At its deadline the box is removed like
kvbox rm --force would (a small detached kvbox process waits for it; no
daemon is needed), within a minute even if no kvbox command runs. The
deadline is kept in the box's libvirt metadata (virsh dumpxml shows
<expires>); kvbox ls shows the time left.`,
		Example: "  kvbox ttl job-17 2h\n  kvbox ttl job-17 none",
		Args:    exactArgs(2, "a box name and a duration (or none)"),
		RunE: func(c *cobra.Command, args []string) error {
			at, err := expiry(args[1])
			if err != nil {
				return err
			}
			k, err := a.lib()
			if err != nil {
				return err
			}
			b, err := k.SetExpires(c.Context(), args[0], at)
			if err != nil {
				return err
			}
			if b.Expires == nil {
				fmt.Fprintf(a.io.Out, "✓ box %s has no TTL: it stays until kvbox rm %s\n", b.Name, b.Name)
			} else {
				fmt.Fprintf(a.io.Out, "✓ box %s is removed at %s (in %s)\n", b.Name, b.Expires.Format(time.RFC3339), ttlLeft(b.Expires))
			}
			return nil
		},
	}
}

// reaperCommand re-runs this kvbox, with the global flags it was given, as
// the reaper of KIND NAME.
func (a *app) reaperCommand(kind, name, id string) *exec.Cmd {
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	// The reaper runs in /: a path given relative to this command's
	// working directory would name another folder there.
	stateDir, template := absOr(a.stateDir), absOr(a.template)
	args := []string{"--connect", a.uri, "--state-dir", stateDir, "--bridge", a.bridge, "--subnet", a.subnet}
	if template != "" {
		args = append(args, "--template", template)
	}
	if a.domType != "" {
		args = append(args, "--domain-type", a.domType)
	}
	cmd := exec.Command(exe, append(args, kvbox.ReaperArg, kind, name, id)...)
	cmd.Dir = "/"
	// Test hooks (kill points, silent agents) are for the command that was
	// run, not for the reapers it leaves behind.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVBOX_TEST_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	return cmd
}

// newCmdReap is the hidden reaper: `kvbox __reap box NAME UUID` or
// `kvbox __reap snapshot NAME CREATED` (kvbox.RunReaper). It runs detached
// (Config.ReaperCommand) and exits when the thing is removed, gone, given
// another identity, or has no deadline any more.
func (a *app) newCmdReap() *cobra.Command {
	return &cobra.Command{
		Use:     kvbox.ReaperArg + " KIND NAME ID",
		Hidden:  true,
		Example: "  (started by kvbox itself: kvbox ttl, new --ttl, snapshots new --ttl)",
		Args:    exactArgs(3, "a kind (box or snapshot), a name and an id"),
		RunE: func(c *cobra.Command, args []string) error {
			a.reaper = true
			k, err := a.lib()
			if err != nil {
				fmt.Fprintf(a.io.Err, "%s reaper[%d] %s %s: %v\n", time.Now().UTC().Format(time.RFC3339), os.Getpid(), args[0], args[1], err)
				return err
			}
			return kvbox.RunReaper(c.Context(), k, args[0], args[1], args[2], a.io.Err)
		},
	}
}

// absOr is p made absolute, or p when that fails (absPaths has said so).
func absOr(p string) string {
	if p == "" || filepath.IsAbs(p) {
		return p
	}
	if abs, err := filepath.Abs(p); err == nil {
		return abs
	}
	return p
}
