package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/terminal"
)

func (a *app) newCmdExec() *cobra.Command {
	var tty bool
	var o execOptions
	c := &cobra.Command{
		Use:   "exec NAME -- COMMAND [ARG...]",
		Short: "Run a command in a box; its exit code is kvbox's",
		Long: `Run a command in a box; its exit code is kvbox's.

The command gets PATH and HOME (and TERM with -t); --env adds to them.
Exit codes besides the command's own: 124 when --timeout passed (its
process group was killed), 125 when --user or --workdir is wrong, 126/127
when the command cannot be run / is not found.`,
		Example: `  kvbox exec dev -- uname -a
  echo hello | kvbox exec dev -- cat
  kvbox exec -t dev -- top
  kvbox exec --env CI=1 --workdir /srv/app --user app --timeout 5m dev -- make test`,
		Args: func(c *cobra.Command, args []string) error {
			if len(args) < 2 {
				return usage("kvbox exec takes a box name and a command (kvbox exec dev -- uname -a)")
			}
			return nil
		},
		RunE: func(c *cobra.Command, args []string) error {
			req := agent.ExecRequest{Argv: args[1:], TTY: tty}
			if err := o.apply(&req); err != nil {
				return err
			}
			return a.runExec(c, args[0], req)
		},
	}
	c.Flags().BoolVarP(&tty, "tty", "t", false, "run the command on a terminal (needs one here)")
	o.flags(c)
	return c
}

// loginShell starts the guest's best shell as a login shell.
var loginShell = []string{"/bin/sh", "-c", `if [ -x /bin/bash ]; then exec /bin/bash -l; fi; exec /bin/sh -l`}

func (a *app) newCmdConnect() *cobra.Command {
	return &cobra.Command{
		Use:     "connect NAME",
		Aliases: []string{"shell"},
		Short:   "Open an interactive shell in a box",
		Example: "  kvbox connect dev",
		Args:    exactArgs(1, "one box name"),
		RunE: func(c *cobra.Command, args []string) error {
			return a.runExec(c, args[0], agent.ExecRequest{Argv: loginShell, TTY: true})
		},
	}
}

// runExec runs req in the box. With a TTY, the local terminal goes to raw
// mode and follows window size changes.
func (a *app) runExec(c *cobra.Command, name string, req agent.ExecRequest) error {
	k, err := a.lib()
	if err != nil {
		return err
	}
	s, err := k.Session(c.Context(), name)
	if err != nil {
		return err
	}
	defer s.Close()

	var resize chan agent.WinSize
	if req.TTY {
		in, ok := a.io.In.(*os.File)
		if !ok || !terminal.IsTerminal(in) {
			return usage("a terminal session needs a terminal on standard input")
		}
		// A request's environment replaces the agent's default one: send
		// the defaults (PATH, HOME) along with this terminal's TERM.
		if req.User == "" {
			req.Env = agent.DefaultEnv(true, os.Getenv("TERM"))
		} else {
			// The agent's defaults hold the user's HOME: add TERM to them.
			req.EnvAdd = append([]string{"TERM=" + termOr(os.Getenv("TERM"))}, req.EnvAdd...)
		}
		resize = make(chan agent.WinSize, 1)
		var restore func()
		req.Rows, req.Cols, restore, err = terminal.Raw(in, func(rows, cols uint16) {
			select {
			case resize <- agent.WinSize{Rows: rows, Cols: cols}:
			default:
			}
		})
		if err != nil {
			return err
		}
		defer restore()
	}
	// The command's bytes, raw: exec and connect are a terminal's own.
	code, err := s.Exec(c.Context(), req, a.raw.In, a.raw.Out, a.raw.Err, resize)
	switch why, msg := kvbox.WhyExec(err); why {
	case kvbox.ExecTimedOut:
		fmt.Fprintf(a.io.Err, "kvbox: %s: %s\n", req.Argv[0], msg)
		return exitCodeError{exitTimedOut}
	case kvbox.ExecRefused:
		fmt.Fprintf(a.io.Err, "kvbox: exec in box %q: %s\n", name, msg)
		return exitCodeError{exitSetup}
	case kvbox.ExecNotStarted: // reported the way a shell does
		fmt.Fprintf(a.io.Err, "kvbox: %s: %s\n", req.Argv[0], msg)
		return exitCodeError{127}
	}
	if err != nil {
		return fmt.Errorf("exec in box %q: %w", name, err)
	}
	return guestExit(code)
}

// guestExit turns a guest command's exit code into kvbox's: a code a
// process cannot exit with (outside 0-255) is an error, never a success by
// truncation (256 would otherwise become 0).
func guestExit(code int) error {
	switch {
	case code == 0:
		return nil
	case code < 0 || code > 255:
		return fmt.Errorf("the agent reported exit code %d, which no process exits with", code)
	}
	return exitCodeError{code}
}
