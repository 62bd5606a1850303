package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/kvbox"
)

func (a *app) newCmdSuspend() *cobra.Command {
	var verbose bool
	c := &cobra.Command{
		Use:   "suspend NAME...",
		Short: "Put boxes to sleep: memory and device state to disk, QEMU gone, RAM and CPU given back",
		Long: `Put boxes to sleep: their memory and device state are saved to disk and their
QEMU exits, so they hold no RAM and no CPU. The guest stands still only while
the last pass of a live copy of its RAM and its device state are saved.

kvbox resume (or kvbox start) wakes a box warm with its own name, MAC and
address: every process runs on where it stopped, connections to it are made
again. While suspended, kvbox ls shows it as suspended and virsh as shut off;
an operator's virsh start fails and says to run kvbox resume (it would boot
over the saved memory). kvbox rm deletes a suspended box with its state.`,
		Example: "  kvbox suspend dev\n  kvbox resume dev",
		Args:    cobra.MinimumNArgs(1),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			for _, n := range args {
				res, err := k.Suspend(c.Context(), n, a.reporter())
				if err != nil {
					return err
				}
				how := "RAM copied live"
				if res.Paused {
					how = "RAM copied while paused (TCG)"
				}
				fmt.Fprintf(a.io.Out, "✓ box %s is suspended (%s, %s on disk, paused %d ms, %.2fs); wake it with: kvbox resume %s\n",
					n, how, base.FormatSize(res.StateBytes), res.Pause.Milliseconds(), res.Total.Seconds(), n)
				if verbose {
					fmt.Fprintf(a.io.Err, "timing: %s (pause %dms), total %dms\n", res.Steps, res.Pause.Milliseconds(), res.Total.Milliseconds())
				}
			}
			return nil
		}),
	}
	c.Flags().BoolVarP(&verbose, "verbose", "v", false, "print where the time went")
	return c
}

func (a *app) newCmdResume() *cobra.Command {
	var timeout time.Duration
	var verbose bool
	c := &cobra.Command{
		Use:   "resume NAME...",
		Short: "Wake suspended boxes warm (or continue paused ones)",
		Long: `Wake suspended boxes from their saved state: same name, MAC and address,
every process running on where it stopped, the disk as it was. A paused box
(one a failed snapshot left paused) just continues.`,
		Example: "  kvbox resume dev",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(c *cobra.Command, args []string) error {
			for _, n := range args {
				if err := a.resumeBox(c, n, timeout, verbose); err != nil {
					return err
				}
			}
			return nil
		},
	}
	c.Flags().DurationVar(&timeout, "timeout", 60*time.Second, "how long to wait for the guest agent")
	c.Flags().BoolVarP(&verbose, "verbose", "v", false, "print where the time went")
	return c
}

// resumeBox wakes a suspended box, continues a paused one or wakes a
// sleeping guest.
func (a *app) resumeBox(c *cobra.Command, n string, timeout time.Duration, verbose bool) error {
	k, err := a.lib()
	if err != nil {
		return err
	}
	res, err := k.Resume(c.Context(), n, timeout, a.reporter())
	if err != nil {
		return err
	}
	switch res.How {
	case kvbox.Unpaused:
		fmt.Fprintf(a.io.Out, "✓ box %s is resumed (it was paused) at %s\n", res.Box.Name, res.Box.IP)
	case kvbox.Woken:
		fmt.Fprintf(a.io.Out, "✓ box %s is awake (its guest was asleep) at %s\n", res.Box.Name, res.Box.IP)
	default:
		fmt.Fprintf(a.io.Out, "✓ box %s is running again at %s, warm from its suspend (%.2fs)\n", n, res.Box.IP, res.Total.Seconds())
		if verbose {
			fmt.Fprintf(a.io.Err, "timing: %s, total %dms\n", res.Steps, res.Total.Milliseconds())
		}
	}
	return nil
}
