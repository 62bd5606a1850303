package kvbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync/atomic"

	"kvbox.dev/kvbox/base"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/progress"
)

// DefaultMaxCopy is the most a copy out of a box writes on the host unless
// told otherwise (CopyOptions.MaxBytes).
const DefaultMaxCopy = agent.DefaultMaxCopy

// CopyOptions say how a copy into or out of a box goes.
type CopyOptions struct {
	// MaxBytes bounds what a copy out of a box writes on the host: its
	// files' sizes, holes included, plus 512 bytes an entry
	// (DefaultMaxCopy when 0). A copy out to a stream is not bounded.
	MaxBytes int64
	// Progress is told the copy's bytes (one Stage) and, as Log lines,
	// what the copy skipped; nil: nobody.
	Progress progress.Reporter
}

// CopyIn copies the local file or tree src into box name as dst (into dst
// when dst is a directory), through its agent: modes and symlinks kept,
// nothing half-written left under a final name.
func (h *Host) CopyIn(ctx context.Context, name, src, dst string, o CopyOptions) error {
	if err := CheckLocal(src); err != nil {
		return err
	}
	return h.copy(ctx, name, o, func(c *agent.Client, n *copyCount, warn func(string)) error {
		return copyTreeIn(ctx, c, n, src, dst, warn)
	})
}

// CopyInStream extracts the tar stream r into the directory dst of box
// name.
func (h *Host) CopyInStream(ctx context.Context, name string, r io.Reader, dst string, o CopyOptions) error {
	return h.copy(ctx, name, o, func(c *agent.Client, n *copyCount, warn func(string)) error {
		_, err := c.CopyIn(ctx, counted{r: r, c: n}, dst, true)
		return err
	})
}

// CopyOut copies src of box name to the local dst. What the box sends is
// untrusted input (agent.ExtractFromBox): the copy is named dst, or src's
// base name as given here inside a directory dst, and bounded by
// o.MaxBytes.
func (h *Host) CopyOut(ctx context.Context, name, src, dst string, o CopyOptions) error {
	return h.copy(ctx, name, o, func(c *agent.Client, n *copyCount, warn func(string)) error {
		return copyOut(ctx, c, n, src, nil, dst, o.maxBytes(), warn)
	})
}

// CopyOutStream writes src of box name to w as a tar stream, as the box
// sends it (the rules of CopyOut are then those of whatever reads it).
func (h *Host) CopyOutStream(ctx context.Context, name, src string, w io.Writer, o CopyOptions) error {
	return h.copy(ctx, name, o, func(c *agent.Client, n *copyCount, warn func(string)) error {
		return copyOut(ctx, c, n, src, w, "", o.maxBytes(), warn)
	})
}

func (o CopyOptions) maxBytes() int64 {
	if o.MaxBytes <= 0 {
		return DefaultMaxCopy
	}
	return o.MaxBytes
}

// copy reaches box name's agent and runs f with it, counting the copy's
// bytes; an error says which side failed.
func (h *Host) copy(ctx context.Context, name string, o CopyOptions, f func(*agent.Client, *copyCount, func(string)) error) error {
	_, client, err := h.dialBox(ctx, name)
	if err != nil {
		return err
	}
	defer client.Close()
	rep := progress.Of(o.Progress)
	n := &copyCount{st: rep.Stage("copy")}
	n.total.Store(-1)
	err = f(client, n, rep.Log)
	n.st.End()
	if err != nil {
		return copyError(name, err, o.maxBytes())
	}
	return nil
}

// CheckLocal reports a local path of a copy that does not exist (kind
// NotFound), before anything reaches a box.
func CheckLocal(p string) error {
	if _, err := os.Lstat(p); err != nil {
		return localPathError(p, err)
	}
	return nil
}

func localPathError(p string, err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return base.Errorf(base.NotFound, "%s: no such file or directory", p)
	}
	return err
}

// copyError says which side failed: a message from the box's side names
// the box; a missing path is NotFound, as a missing box is.
func copyError(box string, err error, maxBytes int64) error {
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

// copyOut copies the box's src to w (a stream, as the box sends it) or,
// when w is nil, to the local dst: untrusted input (agent.ExtractFromBox)
// named after src, as given, and bounded by maxBytes.
func copyOut(ctx context.Context, client *agent.Client, n *copyCount, src string, w io.Writer, dst string, maxBytes int64, warn func(string)) error {
	if w == nil {
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
	total := func(t int64) {
		n.setTotal(t)
		if w == nil && t > maxBytes {
			tooBig.Store(true)
			cancel()
		}
	}
	pr, pw := io.Pipe()
	var guestDone atomic.Bool
	gerrc := make(chan error, 1)
	go func() {
		err := client.CopyOut(ctx, src, counted{w: pw, c: n}, total, warn)
		guestDone.Store(true)
		pw.CloseWithError(err)
		gerrc <- err
	}()
	var lerr error
	if w != nil {
		_, lerr = io.Copy(w, pr)
	} else {
		_, lerr = agent.ExtractFromBox(pr, dst, agent.FromBox{Name: boxBase(src), MaxBytes: maxBytes, Warn: warn})
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
	}
	return lerr
}

// boxBase is the name a copy of the box's path p gets in a host
// directory: its base name as given ("root" for /), as WriteTree names
// its top entry.
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

// copyTreeIn copies the local src to the box's dst as a tar stream.
func copyTreeIn(ctx context.Context, client *agent.Client, n *copyCount, src, dst string, warn func(string)) error {
	if _, total, err := agent.TreeSize(src); err == nil {
		n.setTotal(total)
	}
	pr, pw := io.Pipe()
	var localDone atomic.Bool
	lerrc := make(chan error, 1)
	go func() {
		err := agent.WriteTree(counted{w: pw, c: n}, src, warn)
		localDone.Store(true)
		pw.CloseWithError(err)
		lerrc <- err
	}()
	_, gerr := client.CopyIn(ctx, pr, dst, false)
	localFirst := localDone.Load()
	pr.CloseWithError(io.ErrClosedPipe)
	lerr := <-lerrc
	if lerr != nil && (localFirst || gerr == nil) {
		return lerr
	}
	return gerr
}

// copyCount counts a copy's bytes for its progress stage.
type copyCount struct {
	st          progress.Stage
	done, total atomic.Int64
}

func (n *copyCount) add(b int) { n.st.Bytes(n.done.Add(int64(b)), n.total.Load()) }

func (n *copyCount) setTotal(t int64) {
	n.total.Store(t)
	n.st.Bytes(n.done.Load(), t)
}

// counted is a reader or a writer whose bytes a copyCount counts.
type counted struct {
	r io.Reader
	w io.Writer
	c *copyCount
}

func (c counted) Read(b []byte) (int, error) {
	k, err := c.r.Read(b)
	c.c.add(k)
	return k, err
}

func (c counted) Write(b []byte) (int, error) {
	k, err := c.w.Write(b)
	c.c.add(k)
	return k, err
}
