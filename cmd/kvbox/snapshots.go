package main

import (
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/snapshot"
)

func (a *app) snapshots() snapshot.Store {
	return snapshot.Store{Dir: a.layout().Snapshots()}
}

func (a *app) newCmdSnapshots() *cobra.Command {
	c := &cobra.Command{
		Use:     "snapshots",
		Aliases: []string{"snapshot", "snap"},
		Short:   "Freeze running boxes into snapshots, list and delete them",
	}
	c.AddCommand(a.newCmdSnapshotsNew(), a.newCmdSnapshotsLs(), a.newCmdSnapshotsRm())
	c.AddCommand(a.newCmdSnapshotsPush(), a.newCmdSnapshotsPull(), a.newCmdSnapshotsInspect())
	return c
}

func (a *app) newCmdSnapshotsNew() *cobra.Command {
	var verbose bool
	var ttl string
	c := &cobra.Command{
		Use:   "new BOX NAME",
		Short: "Snapshot a box's memory, CPU state and disk while it keeps running",
		Long: `Snapshot a box's memory, CPU and device state and disk under one name. The box
pauses briefly (only while its memory is saved) and then runs on. Only what the
box touched is stored; a later snapshot of the same box copies only the disk
blocks changed since, and is merged so it stands alone.

A stopped box is booted first (a snapshot holds a running machine, so that its
clones start warm) and stopped again afterwards.

With --ttl the snapshot is removed that long after it was taken; one that
boxes are still cloned from then is kept until the last of them is removed
(kvbox snapshots ls says so).`,
		Example: `  kvbox snapshots new dev warm
  kvbox snapshots new --ttl 2h dev warm-today
  kvbox new --from warm agent-1`,
		Args: exactArgs(2, "a box name and a snapshot name"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			boxName, name := args[0], args[1]
			expires, err := newExpiry(c.Flags().Changed("ttl"), ttl, "snapshot")
			if err != nil {
				return err
			}
			res, err := k.Snapshot(c.Context(), boxName, name, kvbox.SnapshotOptions{Expires: expires, Progress: a.reporter()})
			if err != nil {
				return err
			}
			if res.Note != "" {
				fmt.Fprintf(a.io.Err, "kvbox: note: %s\n", res.Note)
			}
			s := res.Snapshot
			kind := "full"
			if s.Incremental {
				kind = "incremental"
			}
			fmt.Fprintf(a.io.Out, "✓ snapshot %s saved from box %s (%s on disk, %s disk copy, paused %d ms); start a warm clone with: kvbox new --from %s NAME\n",
				s.Name, s.Box, base.FormatSize(s.SizeBytes), kind, res.Pause.Milliseconds(), s.Name)
			if s.Expires != nil {
				fmt.Fprintf(a.io.Out, "  removed at %s (TTL), or once its last clone is removed if it has clones then\n", s.Expires.Format(time.RFC3339))
			}
			if verbose {
				for _, st := range res.Steps {
					fmt.Fprintf(a.io.Err, "  %-18s %6.0f ms\n", st.Name, float64(st.Duration.Microseconds())/1000)
				}
			}
			return nil
		}),
	}
	c.Flags().BoolVarP(&verbose, "verbose", "v", false, "print the time of each step")
	c.Flags().StringVar(&ttl, "ttl", "", "remove the snapshot this long after it is taken (20s, 30m, 2h, 3d); kept while boxes are cloned from it")
	return c
}

// snapshotTTL is the TTL column of a snapshot: the time left, or, once
// passed, that it waits for its clones.
func snapshotTTL(r kvbox.SnapshotInfo) string {
	if r.Expires != nil && !time.Now().Before(*r.Expires) && len(r.Clones) > 0 {
		return fmt.Sprintf("expired, kept until its %d clone(s) are gone", len(r.Clones))
	}
	return ttlLeft(r.Expires)
}

func (a *app) newCmdSnapshotsLs() *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:     "ls",
		Short:   "List snapshots",
		Example: "  kvbox snapshots ls\n  kvbox snapshots ls --json",
		Args:    exactArgs(0, "no arguments"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			rows, err := k.Snapshots(c.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(rows)
			}
			w := a.table("NAME", "BOX", "SIZE-ON-DISK", "CREATED", "CLONES", "TTL")
			for _, r := range rows {
				clones := "-"
				if len(r.Clones) > 0 {
					clones = strings.Join(r.Clones, ",")
				}
				w.row(r.Name, r.Box, base.FormatSize(r.SizeBytes), age(r.Created)+" ago", clones, snapshotTTL(r))
			}
			return w.Flush()
		}),
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return c
}

func (a *app) newCmdSnapshotsRm() *cobra.Command {
	return &cobra.Command{
		Use:     "rm NAME...",
		Short:   "Delete snapshots no box depends on",
		Example: "  kvbox snapshots rm warm",
		Args:    cobra.MinimumNArgs(1),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			for _, n := range args { // every one there, or none removed
				if _, err := k.GetSnapshot(c.Context(), n); err != nil {
					return err
				}
			}
			for _, n := range args {
				if err := k.RemoveSnapshot(c.Context(), n); err != nil {
					return err
				}
				fmt.Fprintf(a.io.Out, "✓ snapshot %s removed\n", n)
			}
			return nil
		}),
	}
}
