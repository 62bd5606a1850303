package main

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/kvbox"
)

func (a *app) newCmdLs() *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List boxes",
		Example: "  kvbox ls\n  kvbox ls --json | jq -r '.[].ip'",
		Args:    exactArgs(0, "no arguments"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			boxes, err := k.Boxes(c.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(boxes)
			}
			w := a.table("NAME", "STATE", "IP", "FROM/IMAGE", "CPUS", "MEMORY", "DISK", "AGE", "TTL")
			for _, b := range boxes {
				w.row(b.Name, b.State, b.IP, b.From(), b.CPUs,
					base.FormatSize(b.MemoryBytes), base.FormatSize(b.DiskBytes), age(b.Created), ttlLeft(b.Expires))
			}
			return w.Flush()
		}),
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return c
}

func (a *app) newCmdIP() *cobra.Command {
	return &cobra.Command{
		Use:     "ip NAME",
		Short:   "Print a box's address (for scripts)",
		Example: "  curl http://$(kvbox ip dev):8000/",
		Args:    exactArgs(1, "one box name"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			b, err := k.Box(c.Context(), args[0])
			if err != nil {
				return err
			}
			fmt.Fprintln(a.io.Out, b.IP)
			return nil
		}),
	}
}

// ttlNote ends a box's line with its deadline, when it has one.
func ttlNote(b domain.Box) string {
	if b.Expires == nil {
		return ""
	}
	return fmt.Sprintf("; removed at %s (TTL)", b.Expires.Format(time.RFC3339))
}

func age(t time.Time) string {
	d := time.Since(t)
	switch {
	case t.IsZero():
		return "-"
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

func (a *app) newCmdStart() *cobra.Command {
	var timeout time.Duration
	c := &cobra.Command{
		Use:     "start NAME",
		Short:   "Boot a stopped box and wait for its agent, or resume a paused or suspended one",
		Example: "  kvbox start dev",
		Args:    exactArgs(1, "one box name"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			if b, err := k.Box(c.Context(), args[0]); err == nil && kvbox.Resumable(b.State) {
				return a.resumeBox(c, args[0], timeout, false)
			}
			stop := a.spin("booting " + args[0] + ", waiting for its agent")
			b, err := k.Start(c.Context(), args[0], timeout)
			stop()
			if b.Name == "" {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ box %s is running at %s\n", b.Name, b.IP)
			for _, p := range b.Published {
				fmt.Fprintf(a.io.Out, "✓ published %s -> %s:%d again\n", p.ListenAddr(), b.Name, p.GuestPort)
			}
			return err
		}),
	}
	c.Flags().DurationVar(&timeout, "timeout", 90*time.Second, "how long to wait for the guest agent")
	return c
}

func (a *app) newCmdStop() *cobra.Command {
	var timeout time.Duration
	var force bool
	c := &cobra.Command{
		Use:     "stop NAME...",
		Short:   "Shut boxes down (ACPI, then power off after --timeout)",
		Example: "  kvbox stop dev\n  kvbox stop --force dev",
		Args:    cobra.MinimumNArgs(1),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			for _, n := range args {
				if err := k.Stop(c.Context(), n, force, timeout); err != nil {
					return err
				}
				fmt.Fprintf(a.io.Out, "✓ box %s is stopped\n", n)
			}
			return nil
		}),
	}
	c.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long the guest may take to shut down")
	c.Flags().BoolVarP(&force, "force", "f", false, "power off at once")
	return c
}

func (a *app) newCmdRm() *cobra.Command {
	var force bool
	c := &cobra.Command{
		Use:     "rm NAME...",
		Aliases: []string{"remove"},
		Short:   "Delete boxes: domain, folder (disk, saved state) and address",
		Long: `Delete boxes: domain, folder (disk, saved state) and address. Several boxes are removed
in parallel; every name is handled and each failure reported, and kvbox exits
non-zero only if one failed. With --force running boxes are powered off first,
and a name that is no box is skipped quietly (as rm -f does).`,
		Example: "  kvbox rm dev\n  kvbox rm --force agent-1 agent-2",
		Args:    cobra.MinimumNArgs(1),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			return a.removeBoxes(c.Context(), k, args, force)
		}),
	}
	c.Flags().BoolVarP(&force, "force", "f", false, "remove running boxes too")
	return c
}

// removeBoxes removes every named box, several at a time: each name is
// handled and each failure reported (one name: its error is the one line).
func (a *app) removeBoxes(ctx context.Context, k *kvbox.Host, names []string, force bool) error {
	many := len(slices.Compact(slices.Sorted(slices.Values(names)))) > 1
	return k.RemoveMany(ctx, names, force, func(o kvbox.Outcome) {
		switch {
		case o.Err == nil:
			fmt.Fprintf(a.io.Out, "✓ box %s is removed\n", o.Name)
		case many:
			fmt.Fprintf(a.io.Err, "kvbox: %s\n", o.Err.Error())
		}
	})
}
