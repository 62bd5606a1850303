package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/terminal"
)

func (a *app) newCmdCp() *cobra.Command {
	var maxSize string
	c := &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a file or a tree into or out of a box, through its agent",
		Long: `Copy a file or a whole tree into or out of a box. One side is BOX:PATH.

The copy goes through the box's agent, so it works with no network in the box.
A directory destination receives SRC under its own name; otherwise SRC is
written as DST, whose parent must exist. Modification and access times are
kept, owners are not (the side that writes owns the files). Into a box, modes
(setuid/setgid/sticky too) and symlinks are kept (never followed, the top one
included, as cp -a does), and a tree copied onto an existing directory is
merged into it.

Out of a box, what the box sends is untrusted input (the box may be hostile,
and kvbox runs as root). The name written on the host is DST, or SRC's base
name as typed here, never one the box chooses. A tree is never merged into
what exists on the host: a tree whose name exists is refused (a file replaces
a file). Modes lose setuid, setgid, sticky, group and world write. Symlinks
pointing outside the copy are skipped with a warning, and a copy that is only
such a link is refused; hard links, devices and fifos are refused. The copy
writes at most --max-size (its files' sizes, holes included, plus 512 bytes an
entry), and runs of zeroes are written as holes, so that a sparse entry
claiming gigabytes writes none of them.

Nothing half-written is left at the destination: each file is written under a
temporary name (.kvbox-cp-…) beside it and renamed when complete, and a new
tree is built in a temporary directory and renamed into place whole. Only a
kvbox killed mid-copy (SIGKILL, or the box's side killed) can leave such a
temporary name behind, never a partial file under the final name.

SRC - reads a tar stream from stdin and extracts it into the directory
BOX:DST; DST - writes BOX:SRC to stdout as a tar stream, as the box sends it
(the rules above are then those of whatever reads it).`,
		Example: `  kvbox cp ./repo dev:/srv/
  kvbox cp dev:/srv/out/report.json .
  kvbox cp --max-size 64G dev:/srv/dataset ./data
  tar -C src -c . | kvbox cp - dev:/srv/app
  kvbox cp dev:/var/log - | tar -t`,
		Args: exactArgs(2, "a source and a destination (kvbox cp ./repo dev:/srv/)"),
		RunE: func(c *cobra.Command, args []string) error {
			maxBytes, err := base.ParseSize(maxSize)
			if err != nil {
				return usage("--max-size %q is not a size like 16G", maxSize)
			}
			return a.runCp(c.Context(), args[0], args[1], maxBytes)
		},
		ValidArgsFunction: func(c *cobra.Command, args []string, prefix string) ([]string, cobra.ShellCompDirective) {
			return nil, cobra.ShellCompDirectiveDefault
		},
	}
	c.Flags().StringVar(&maxSize, "max-size", envOr("KVBOX_CP_MAX_SIZE", fmt.Sprintf("%dG", kvbox.DefaultMaxCopy>>30)),
		"the most a copy out of a box may write on the host, like 64G (KVBOX_CP_MAX_SIZE)")
	return c
}

// splitBoxPath splits "BOX:PATH"; ok is false for a local path (no colon
// before the first slash: ./a:b is local).
func splitBoxPath(s string) (box, path string, ok bool) {
	i := strings.IndexByte(s, ':')
	if i <= 0 || strings.Contains(s[:i], "/") {
		return "", s, false
	}
	return s[:i], s[i+1:], true
}

func (a *app) runCp(ctx context.Context, src, dst string, maxBytes int64) error {
	sbox, spath, sremote := splitBoxPath(src)
	dbox, dpath, dremote := splitBoxPath(dst)
	switch {
	case sremote == dremote:
		return usage("one of SRC and DST must be BOX:PATH, the other a local path or - (kvbox cp ./repo dev:/srv/)")
	case sremote && spath == "", dremote && dpath == "":
		return usage("BOX:PATH needs a path after the colon (dev:/srv)")
	case sremote && !strings.HasPrefix(spath, "/"), dremote && !strings.HasPrefix(dpath, "/"):
		return usage("the path in a box must be absolute (dev:/srv, not dev:srv)")
	}
	box := sbox
	if dremote {
		box = dbox
	}
	if err := base.ValidName(box); err != nil {
		return err
	}
	if dremote && src != "-" {
		// Check the local side before reaching the box.
		if err := kvbox.CheckLocal(src); err != nil {
			return err
		}
	}
	k, err := a.lib()
	if err != nil {
		return err
	}
	prog := a.copyProgress()
	o := kvbox.CopyOptions{MaxBytes: maxBytes, Progress: prog}
	switch {
	case sremote && dst == "-":
		err = k.CopyOutStream(ctx, box, spath, a.raw.Out, o) // a tar stream, for a program
	case sremote:
		err = k.CopyOut(ctx, box, spath, dst, o)
	case src == "-":
		err = k.CopyInStream(ctx, box, a.io.In, dpath, o)
	default:
		err = k.CopyIn(ctx, box, src, dpath, o)
	}
	if err != nil {
		return err
	}
	prog.Summary("copied")
	return nil
}

// copyProgress is cp's status line on stderr when it is a terminal, drawn
// once the copy has taken a second (KVBOX_PROGRESS_AFTER, a Go duration,
// says otherwise: the tests draw it for a copy of any length); what the
// copy skips is a warning.
func (a *app) copyProgress() *terminal.Progress {
	after := time.Second
	if d, err := time.ParseDuration(os.Getenv("KVBOX_PROGRESS_AFTER")); err == nil && d >= 0 {
		after = d
	}
	return terminal.New(terminal.Options{Term: terminal.IfTerminal(a.raw.Err), Log: a.io.Err, Prefix: "kvbox: cp: ", After: after})
}
