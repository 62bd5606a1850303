package main

import (
	"bufio"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/registry"
)

// registryFlags are the flags every command that talks to a registry has.
type registryFlags struct {
	insecure      bool
	username      string
	passwordStdin bool
}

func (f *registryFlags) add(c *cobra.Command) {
	c.Flags().BoolVar(&f.insecure, "insecure", false, "talk plain HTTP to the registry")
	c.Flags().StringVar(&f.username, "username", "", "registry user (else docker's config.json is used)")
	c.Flags().BoolVar(&f.passwordStdin, "password-stdin", false, "read the registry password from standard input")
}

// options are the registry options of the flags; the per-part log and
// the parts' lines are the terminal's (a.reporter), none when quiet (--json).
func (f *registryFlags) options(a *app, quiet bool) (registry.Options, error) {
	o := registry.Options{Insecure: f.insecure, Username: f.username}
	if !quiet {
		o.Progress = a.reporter()
	}
	if f.passwordStdin {
		if f.username == "" {
			return o, usage("--password-stdin needs --username")
		}
		line, err := bufio.NewReader(a.io.In).ReadString('\n')
		if err != nil && err != io.EOF {
			return o, err
		}
		o.Password = strings.TrimRight(line, "\r\n")
	} else if f.username != "" {
		return o, usage("--username needs --password-stdin")
	}
	return o, nil
}

// transfer runs a push or a pull and, when asked, prints its result as
// JSON: done says nothing is left to print.
func transfer[R any](a *app, o registry.Options, asJSON bool, run func(registry.Options) (R, error)) (res R, done bool, err error) {
	res, err = run(o)
	if err != nil {
		return res, true, err
	}
	if asJSON {
		return res, true, a.printJSON(res)
	}
	return res, false, nil
}

func (a *app) newCmdSnapshotsPush() *cobra.Command {
	var rf registryFlags
	var asJSON bool
	c := &cobra.Command{
		Use:   "push NAME REF",
		Short: "Send a snapshot, and the base image under it, to an OCI registry",
		Long: `Send a snapshot to an OCI registry as an artifact: its memory, device state,
disk and domain XML, and the base image's files, each a layer compressed with
zstd that keeps holes out (only touched memory travels). Layers are content-
addressed: pushing a snapshot again sends only the parts that changed.`,
		Example: `  kvbox snapshots push warm registry.example:5000/team/warm:v3
  kvbox snapshots push --insecure warm 127.0.0.1:5000/warm:latest`,
		Args:              exactArgs(2, "a snapshot name and a registry reference"),
		ValidArgsFunction: a.completeSnapshots,
		RunE: func(c *cobra.Command, args []string) error {
			o, err := rf.options(a, asJSON)
			if err != nil {
				return err
			}
			k, err := a.lib()
			if err != nil {
				return err
			}
			if _, err := k.GetSnapshot(c.Context(), args[0]); err != nil {
				return err
			}
			fmt.Fprintf(a.io.Err, "pushing snapshot %s to %s\n", args[0], args[1])
			res, done, err := transfer(a, o, asJSON, func(o registry.Options) (registry.PushResult, error) {
				return k.Push(c.Context(), args[0], args[1], o)
			})
			if done {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ pushed %s@%s: %s sent, %s on disk (encode %.1fs, transfer %.1fs)\n",
				res.Ref, res.Digest, base.FormatSize(res.Sent), base.FormatSize(res.OnDisk), res.Encode.Seconds(), res.Transfer.Seconds())
			return nil
		},
	}
	rf.add(c)
	c.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return c
}

func (a *app) newCmdSnapshotsPull() *cobra.Command {
	var rf registryFlags
	var asJSON bool
	c := &cobra.Command{
		Use:   "pull REF NAME",
		Short: "Fetch a snapshot from an OCI registry, after checking this host can restore it",
		Long: `Fetch a snapshot pushed with kvbox snapshots push. The host is checked first
(domain type, machine type, QEMU version, CPU): a snapshot it cannot restore is
refused before anything is downloaded. Every part is verified against its
digest; the snapshot is listed only once complete. An interrupted pull keeps the
parts it verified and fetches only the rest when run again.

A pulled snapshot is untrusted input: its domain is kvbox's own template with
the machine, CPU, sizes and device addresses it carries, and one that asks for
anything more (QEMU arguments, other devices, host files, a disk that names
another file, more bytes than it declared or than the disk has free) is
refused in one line, leaving nothing behind. Its clones join no box group.`,
		Example: `  kvbox snapshots pull registry.example:5000/team/warm:v3 warm
  kvbox new --from warm agent-1`,
		Args: exactArgs(2, "a registry reference and a snapshot name"),
		RunE: func(c *cobra.Command, args []string) error {
			o, err := rf.options(a, asJSON)
			if err != nil {
				return err
			}
			if err := base.ValidName(args[1]); err != nil {
				return err
			}
			k, err := a.lib()
			if err != nil {
				return err
			}
			res, done, err := transfer(a, o, asJSON, func(o registry.Options) (registry.PullResult, error) {
				return k.Pull(c.Context(), args[0], args[1], o)
			})
			if done {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ snapshot %s pulled from %s@%s: %s received, %s on disk (transfer %.1fs, unpack %.1fs); start a warm clone with: kvbox new --from %s NAME\n",
				res.Snapshot.Name, args[0], res.Digest, base.FormatSize(res.Received), base.FormatSize(res.Snapshot.SizeBytes),
				res.Transfer.Seconds(), res.Decode.Seconds(), res.Snapshot.Name)
			return nil
		},
	}
	rf.add(c)
	c.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return c
}

func (a *app) newCmdSnapshotsInspect() *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:               "inspect NAME",
		Short:             "Show a snapshot's lineage, its cost on disk and what a host needs to restore it",
		Example:           "  kvbox snapshots inspect warm\n  kvbox snapshots inspect --json warm",
		Args:              exactArgs(1, "a snapshot name"),
		ValidArgsFunction: a.completeSnapshots,
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			in, err := k.Inspect(c.Context(), args[0])
			if err != nil {
				return err
			}
			compat := in.Needs
			if asJSON {
				return a.printJSON(in)
			}
			w := a.io.Out
			fmt.Fprintf(w, "snapshot   %s\n", in.Name)
			parent := in.Parent
			if parent == "" {
				parent = "-"
			}
			fmt.Fprintf(w, "lineage    image %s -> box %s (cloned from snapshot %s) -> %s\n", in.Image, in.Box, parent, in.Name)
			fmt.Fprintf(w, "on disk    %s own, standing on base image %s (%s, shared with every snapshot of it)\n",
				base.FormatSize(in.SizeBytes), in.BaseDisk, base.FormatSize(in.BaseBytes))
			fmt.Fprintf(w, "memory     %s guest RAM\n", base.FormatSize(in.MemoryBytes))
			fmt.Fprintf(w, "clones     %d mapping it: %s\n", len(in.Clones), strings.Join(in.Clones, ", "))
			fmt.Fprintf(w, "needs      domain type %s, %s machine %s, CPU %s %s, QEMU >= %s (libvirt %s took it)\n",
				compat.DomainType, compat.Arch, compat.Machine, compat.CPUMode, compat.CPUModel,
				verString(compat.QEMU), verString(compat.Libvirt))
			fmt.Fprintf(w, "this host  %s\n", in.HostOK)
			return nil
		}),
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print a JSON object")
	return c
}

func verString(v uint64) string {
	return fmt.Sprintf("%d.%d.%d", v/1000000, v/1000%1000, v%1000)
}
