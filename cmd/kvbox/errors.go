package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
)

// Exit codes. A command run by `kvbox exec` returns its own code instead.
const (
	exitError       = 1
	exitUsage       = 2
	exitNotFound    = 3
	exitExists      = 4
	exitBusy        = 5
	exitUnavailable = 6
	// exitInterrupted is a shell's code for a command ended by SIGINT.
	exitInterrupted = 130
)

// exitError carries the exit code of a command run in a box.
type exitCodeError struct{ code int }

func (e exitCodeError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// exitCode is kvbox's exit code for err (the README lists them).
func exitCode(err error) int {
	switch {
	case errors.Is(err, base.ErrInterrupted), errors.Is(err, context.Canceled):
		return exitInterrupted
	case errors.Is(err, base.ErrInvalid):
		return exitUsage
	case errors.Is(err, base.ErrNotFound):
		return exitNotFound
	case errors.Is(err, base.ErrExists):
		return exitExists
	case errors.Is(err, base.ErrBusy):
		return exitBusy
	case errors.Is(err, base.ErrUnavailable):
		return exitUnavailable
	}
	return exitError
}

// usage is an error in how kvbox was called: kind Invalid (exit 2), the
// message as given. No error carries its kind in its text: the kind picks
// the exit code, the text is printed as it is.
func usage(format string, a ...any) error { return base.Errorf(base.Invalid, format, a...) }

// rejectUnknown makes every command group (a command with subcommands)
// fail with a usage error on a word it does not know, instead of printing
// its help and exiting 0 as cobra does: a script must not believe
// `kvbox snapshots push a b` worked.
func rejectUnknown(c *cobra.Command) {
	for _, sub := range c.Commands() {
		rejectUnknown(sub)
	}
	if !c.HasSubCommands() || c.Run != nil || c.RunE != nil {
		return
	}
	c.Args = cobra.ArbitraryArgs
	c.RunE = func(c *cobra.Command, args []string) error {
		if len(args) > 0 {
			return usage("unknown command %q for %q (see %s --help)", args[0], c.CommandPath(), c.CommandPath())
		}
		return c.Help()
	}
}

// args checks positional arguments with a usage error that says what is
// expected.
func exactArgs(n int, what string) cobra.PositionalArgs {
	return func(c *cobra.Command, args []string) error {
		if len(args) != n {
			return usage("%s takes %s (see %s --help)", c.CommandPath(), what, c.CommandPath())
		}
		return nil
	}
}
