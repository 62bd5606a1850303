package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"kvbox.dev/kvbox/base"
	agent "kvbox.dev/kvbox/guest-agent"
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
	c.Flags().StringVar(&maxSize, "max-size", envOr("KVBOX_CP_MAX_SIZE", fmt.Sprintf("%dG", agent.DefaultMaxCopy>>30)),
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
	boxName := sbox
	if dremote {
		boxName = dbox
	}
	if err := base.ValidName(boxName); err != nil {
		return err
	}
	if dremote && src != "-" {
		// Check the local side before reaching the box.
		if _, err := os.Lstat(src); err != nil {
			return localPathError(src, err)
		}
	}
	h, err := a.Host()
	if err != nil {
		return err
	}
	b, err := h.Get(boxName)
	if err != nil {
		return err
	}
	client, err := a.dial(ctx, h, b)
	if err != nil {
		return err
	}
	defer client.Close()
	prog := a.newCopyProgress()
	defer prog.stop()
	if sremote {
		err = a.copyOut(ctx, client, prog, spath, dst, maxBytes)
	} else {
		err = a.copyIn(ctx, client, prog, src, dpath)
	}
	prog.stop()
	if err != nil {
		return cpError(boxName, err)
	}
	prog.summary()
	return nil
}

func localPathError(p string, err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return base.Errorf(base.NotFound, "%s: no such file or directory", p)
	}
	return err
}

// cpError says which side failed: a message from the box's side names the
// box; a missing path exits 3, as a missing box does.
func cpError(box string, err error) error {
	var fe *agent.FilesError
	if errors.As(err, &fe) {
		if fe.NotFound {
			return base.Errorf(base.NotFound, "box %q: %s", box, fe.Msg)
		}
		return fmt.Errorf("box %q: %s", box, fe.Msg)
	}
	if errors.Is(err, agent.ErrPathNotFound) {
		return base.Errorf(base.NotFound, "%w", err)
	}
	var big *agent.TooBigError
	if errors.As(err, &big) {
		at := ""
		if big.At != "" {
			at = " (at " + big.At + ")"
		}
		return fmt.Errorf("box %q: the copy would write more than --max-size %s on the host%s; nothing was written (a larger --max-size or KVBOX_CP_MAX_SIZE lets it through)", box, base.FormatSize(big.Limit), at)
	}
	if errors.Is(err, agent.ErrTooOld) {
		return fmt.Errorf("box %q: %w", box, err)
	}
	return err
}

// copyOut copies BOX:src to the local dst (or stdout for -). A copy to a
// file or tree is untrusted input (agent.ExtractFromBox) named after src,
// as typed, and bounded by maxBytes; one to stdout goes as the box sends it.
func (a *app) copyOut(ctx context.Context, client *agent.Client, prog *copyProgress, src, dst string, maxBytes int64) error {
	if dst != "-" {
		// Fail before any byte moves when dst's directory is missing.
		if err := localDestOK(dst); err != nil {
			return err
		}
	}
	// When the local side fails, the box's side is killed (SIGPIPE would
	// not stop it: a Go program ignores a SIGPIPE it did not cause).
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The box says first how much it will send: more than maxBytes is refused
	// before a byte is written (the extractor bounds what it is sent
	// whatever the box said).
	var tooBig atomic.Bool
	total := func(n int64) {
		prog.setTotal(n)
		if dst != "-" && n > maxBytes {
			tooBig.Store(true)
			cancel()
		}
	}
	pr, pw := io.Pipe()
	var guestDone atomic.Bool
	gerrc := make(chan error, 1)
	go func() {
		err := client.CopyOut(ctx, src, prog.count(pw), total, a.cpWarn)
		guestDone.Store(true)
		pw.CloseWithError(err)
		gerrc <- err
	}()
	var lerr error
	if dst == "-" {
		_, lerr = io.Copy(a.raw.Out, pr) // a tar stream, for a program
	} else {
		_, lerr = agent.ExtractFromBox(pr, dst, agent.FromBox{Name: boxBase(src), MaxBytes: maxBytes, Warn: a.cpWarn})
	}
	guestFirst := guestDone.Load()
	if lerr != nil {
		cancel()
	}
	pr.CloseWithError(errors.Join(lerr, io.ErrClosedPipe))
	gerr := <-gerrc
	switch {
	case tooBig.Load():
		return &agent.TooBigError{Limit: maxBytes, At: src + " in the box"}
	case gerr != nil && (guestFirst || lerr == nil):
		return gerr
	case lerr != nil:
		return lerr
	}
	return nil
}

// boxBase is the name a copy of the box's path p gets in a host
// directory: its base name as the user typed it ("root" for /), as
// WriteTree names its top entry.
func boxBase(p string) string {
	b := path.Base(path.Clean(p))
	if b == "/" || b == "." {
		return "root"
	}
	return b
}

// localDestOK reports a destination whose directory is missing.
func localDestOK(dst string) error {
	if _, err := os.Stat(dst); err == nil {
		return nil
	}
	if strings.HasSuffix(dst, "/") {
		return localPathError(dst, os.ErrNotExist)
	}
	parent := filepath.Dir(dst)
	st, err := os.Stat(parent)
	if err != nil {
		return localPathError(parent, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("%s: not a directory", parent)
	}
	return nil
}

// copyIn copies the local src (or a tar stream on stdin for -) to BOX:dst.
func (a *app) copyIn(ctx context.Context, client *agent.Client, prog *copyProgress, src, dst string) error {
	if src == "-" {
		_, err := client.CopyIn(ctx, prog.countReader(a.io.In), dst, true)
		return err
	}
	if _, total, err := agent.TreeSize(src); err == nil {
		prog.setTotal(total)
	}
	pr, pw := io.Pipe()
	var localDone atomic.Bool
	lerrc := make(chan error, 1)
	go func() {
		err := agent.WriteTree(prog.count(pw), src, a.cpWarn)
		localDone.Store(true)
		pw.CloseWithError(err)
		lerrc <- err
	}()
	_, gerr := client.CopyIn(ctx, pr, dst, false)
	localFirst := localDone.Load()
	pr.CloseWithError(io.ErrClosedPipe)
	lerr := <-lerrc
	switch {
	case lerr != nil && (localFirst || gerr == nil):
		return lerr
	case gerr != nil:
		return gerr
	}
	return nil
}

func (a *app) cpWarn(s string) { fmt.Fprintf(a.io.Err, "kvbox: cp: %s\n", s) }

// copyProgress counts the bytes of a copy and, on a terminal, draws one
// status line once the copy has taken more than a second
// (KVBOX_PROGRESS_AFTER, a Go duration, says otherwise: the tests draw it
// for a copy of any length).
type copyProgress struct {
	w       io.Writer // nil: not a terminal
	after   time.Duration
	start   time.Time
	done    atomic.Int64
	total   atomic.Int64
	quit    chan struct{}
	once    sync.Once
	wg      sync.WaitGroup
	drawn   atomic.Bool
	stopped atomic.Bool
}

func (a *app) newCopyProgress() *copyProgress {
	p := &copyProgress{start: time.Now(), after: time.Second, quit: make(chan struct{})}
	if d, err := time.ParseDuration(os.Getenv("KVBOX_PROGRESS_AFTER")); err == nil && d >= 0 {
		p.after = d
	}
	p.total.Store(-1)
	if f, ok := a.raw.Err.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.w = f
		p.wg.Add(1)
		go p.loop()
	}
	return p
}

func (p *copyProgress) setTotal(n int64) { p.total.Store(n) }

func (p *copyProgress) loop() {
	defer p.wg.Done()
	draw := func() {
		if time.Since(p.start) >= p.after {
			fmt.Fprint(p.w, "\r\033[K  "+p.line())
			p.drawn.Store(true)
		}
	}
	draw()
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.quit:
			return
		case <-t.C:
			draw()
		}
	}
}

func (p *copyProgress) line() string {
	done, total := p.done.Load(), p.total.Load()
	secs := time.Since(p.start).Seconds()
	rate := ""
	if secs > 0 {
		rate = fmt.Sprintf(" at %s/s", base.FormatSize(int64(float64(done)/secs)))
	}
	if total > 0 {
		return fmt.Sprintf("%s of %s (%d%%)%s", base.FormatSize(min(done, total)), base.FormatSize(total), min(done, total)*100/total, rate)
	}
	return fmt.Sprintf("%s%s", base.FormatSize(done), rate)
}

func (p *copyProgress) stop() {
	p.once.Do(func() {
		close(p.quit)
		p.wg.Wait()
		if p.drawn.Load() {
			fmt.Fprint(p.w, "\r\033[K")
		}
	})
}

// summary prints, on a terminal and for a copy that showed progress, what
// was moved and how fast.
func (p *copyProgress) summary() {
	if p.drawn.Load() {
		fmt.Fprintf(p.w, "copied %s in %.1fs\n", p.line(), time.Since(p.start).Seconds())
	}
}

type countWriter struct {
	w io.Writer
	p *copyProgress
}

func (c countWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.p.done.Add(int64(n))
	return n, err
}

type countReader struct {
	r io.Reader
	p *copyProgress
}

func (c countReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.p.done.Add(int64(n))
	return n, err
}

func (p *copyProgress) count(w io.Writer) io.Writer       { return countWriter{w, p} }
func (p *copyProgress) countReader(r io.Reader) io.Reader { return countReader{r, p} }
