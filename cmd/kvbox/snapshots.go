package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
)

func (a *app) snapshots() snapshot.Store {
	return snapshot.Store{Dir: a.stateDir + "/snapshots"}
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
	c := &cobra.Command{
		Use:   "new BOX NAME",
		Short: "Snapshot a box's memory, CPU state and disk while it keeps running",
		Long: `Snapshot a box's memory, CPU and device state and disk under one name. The box
pauses briefly (only while its memory is saved) and then runs on. Only what the
box touched is stored; a later snapshot of the same box copies only the disk
blocks changed since, and is merged so it stands alone.

A stopped box is booted first (a snapshot holds a running machine, so that its
clones start warm) and stopped again afterwards.`,
		Example: `  kvbox snapshots new dev warm
  kvbox new --from warm agent-1`,
		Args: exactArgs(2, "a box name and a snapshot name"),
		RunE: func(c *cobra.Command, args []string) error {
			h, err := a.Host()
			if err != nil {
				return err
			}
			boxName, name := args[0], args[1]
			booting := func() func() {
				fmt.Fprintf(a.io.Err, "box %s is stopped: booting it for the snapshot, it is stopped again afterwards\n", boxName)
				return a.spin("booting " + boxName)
			}
			saving := func() func() { return a.spin("saving " + boxName + " as " + name) }
			res, err := snapshot.CreateOf(c.Context(), h, a.snapshots(), boxName, name, booting, saving)
			if err != nil {
				return err
			}
			s := res.Snapshot
			kind := "full"
			if s.Incremental {
				kind = "incremental"
			}
			fmt.Fprintf(a.io.Out, "✓ snapshot %s saved from box %s (%s on disk, %s disk copy, paused %d ms); start a warm clone with: kvbox new --from %s NAME\n",
				s.Name, s.Box, domain.FormatSize(s.SizeBytes), kind, res.Pause.Milliseconds(), s.Name)
			if verbose {
				for _, st := range res.Steps {
					fmt.Fprintf(a.io.Out, "  %-18s %6.0f ms\n", st.Name, float64(st.Duration.Microseconds())/1000)
				}
			}
			return nil
		},
	}
	c.Flags().BoolVarP(&verbose, "verbose", "v", false, "print the time of each step")
	return c
}

// snapshotRow is an element of `kvbox snapshots ls --json`.
type snapshotRow struct {
	snapshot.Snapshot
	Clones []string `json:"clones"`
}

func (a *app) newCmdSnapshotsLs() *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:     "ls",
		Short:   "List snapshots",
		Example: "  kvbox snapshots ls\n  kvbox snapshots ls --json",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, args []string) error {
			boxes, err := a.boxes()
			if err != nil {
				return err
			}
			snaps, err := a.snapshots().List()
			if err != nil {
				return err
			}
			rows := []snapshotRow{}
			for _, s := range snaps {
				r := snapshotRow{Snapshot: s, Clones: []string{}}
				for _, b := range boxes {
					if b.Snapshot == s.Name {
						r.Clones = append(r.Clones, b.Name)
					}
				}
				rows = append(rows, r)
			}
			if asJSON {
				return a.printJSON(rows)
			}
			w := a.table("NAME", "BOX", "SIZE-ON-DISK", "CREATED", "CLONES")
			for _, r := range rows {
				clones := "-"
				if len(r.Clones) > 0 {
					clones = strings.Join(r.Clones, ",")
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s ago\t%s\n", r.Name, r.Box, domain.FormatSize(r.SizeBytes), age(r.Created), clones)
			}
			return w.Flush()
		},
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
		RunE: func(c *cobra.Command, args []string) error {
			h, err := a.Host()
			if err != nil {
				return err
			}
			for _, n := range args {
				if _, err := a.snapshots().Get(n); err != nil {
					return err
				}
			}
			for _, n := range args {
				if err := snapshot.Remove(h, a.snapshots(), n); err != nil {
					return err
				}
				fmt.Fprintf(a.io.Out, "✓ snapshot %s removed\n", n)
			}
			return nil
		},
	}
}
