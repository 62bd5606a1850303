package agent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
)

func init() { registerHelper(FilesHelperArg, runFilesHelper) }

// runFilesHelper is the agent binary's main when run as the file helper
// (argv[1] == FilesHelperArg), by an exec from CopyIn or CopyOut:
//
//	send SRC          tar of SRC on stdout; "total N" first on stderr
//	recv DST          a WriteTree stream on stdin put at DST (cp's rules)
//	recv-stream DIR   any tar stream on stdin extracted into DIR
//
// Errors are one line on stderr; the exit code is 3 for a missing path.
func runFilesHelper(args []string) int {
	if len(args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: kvbox-agent files-helper send|recv|recv-stream PATH")
		return filesExitUsage
	}
	var err error
	switch args[0] {
	case "send":
		var total int64
		if _, total, err = TreeSize(args[1]); err == nil {
			fmt.Fprintf(os.Stderr, "total %d\n", total)
			w := bufio.NewWriterSize(os.Stdout, 256<<10)
			if err = WriteTree(w, args[1], func(s string) { fmt.Fprintln(os.Stderr, "warning: "+s) }); err == nil {
				err = w.Flush()
			}
		} else {
			err = statError(args[1], errors.Unwrap(err))
			if _, serr := os.Lstat(args[1]); serr != nil {
				err = statError(args[1], serr)
			}
		}
	case "recv":
		var final string
		if final, err = ExtractTree(os.Stdin, args[1]); err == nil {
			fmt.Println(final)
		}
	case "recv-stream":
		err = ExtractStream(os.Stdin, args[1])
	default:
		err = fmt.Errorf("unknown files-helper operation %q", args[0])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		if errors.Is(err, ErrPathNotFound) {
			return filesExitNotFound
		}
		return filesExitFailed
	}
	return 0
}

// FilesError is what the guest's side of a copy reported.
type FilesError struct {
	Msg      string
	NotFound bool // the source, or the destination's directory, is missing
}

func (e *FilesError) Error() string { return e.Msg }

// Is makes a missing path errors.Is(err, ErrPathNotFound).
func (e *FilesError) Is(target error) bool { return target == ErrPathNotFound && e.NotFound }

// CopyOut writes src in the guest (a file, a tree or a symlink) to w as a
// tar stream (WriteTree's). total, when not nil, is told the bytes of the
// regular files to come before the first one is sent; warn, when not nil,
// gets each skipped entry.
func (c *Client) CopyOut(ctx context.Context, src string, w io.Writer, total func(int64), warn func(string)) error {
	if err := c.require(ctx, "kvbox cp", FeatureFiles); err != nil {
		return err
	}
	return c.runHelper(ctx, []string{"send", src}, nil, w, total, warn)
}

// CopyIn puts the tar stream r (WriteTree's) at dst in the guest, with cp's
// rules, and returns the path it wrote. With stream, r may be any tar
// stream and dst must be an existing directory it is extracted into.
func (c *Client) CopyIn(ctx context.Context, r io.Reader, dst string, stream bool) (string, error) {
	if err := c.require(ctx, "kvbox cp", FeatureFiles); err != nil {
		return "", err
	}
	op := "recv"
	if stream {
		op = "recv-stream"
	}
	var out strings.Builder
	if err := c.runHelper(ctx, []string{op, dst}, r, &limitedWriter{w: &out, n: 4096}, nil, nil); err != nil {
		return "", err
	}
	if stream {
		return dst, nil
	}
	return strings.TrimSpace(out.String()), nil
}

func (c *Client) require(ctx context.Context, what string, fs ...string) error {
	c.infoOnce.Lock()
	defer c.infoOnce.Unlock()
	if c.info == nil {
		in, err := c.Ping(ctx)
		if err != nil {
			return err
		}
		c.info = &in
	}
	return c.info.Require(what, fs...)
}

func (c *Client) runHelper(ctx context.Context, args []string, stdin io.Reader, stdout io.Writer, total func(int64), warn func(string)) error {
	if stdin == nil {
		stdin = strings.NewReader("")
	}
	ew := &helperStderr{total: total, warn: warn}
	req := ExecRequest{Argv: append([]string{selfArgv0, FilesHelperArg}, args...)}
	code, err := c.Exec(ctx, req, stdin, stdout, ew, nil)
	ew.flush()
	if code > 0 {
		msg := strings.TrimSpace(ew.last)
		if msg == "" {
			msg = "the guest's side of the copy failed (exit " + strconv.Itoa(code) + ")"
		}
		if err != nil && ctx.Err() == nil && !strings.Contains(err.Error(), "writing output") {
			msg += " (" + err.Error() + ")"
		}
		return &FilesError{Msg: msg, NotFound: code == filesExitNotFound}
	}
	return err
}

// helperStderr reads the helper's stderr lines: "total N", "warning: …",
// and keeps the last other line (the error).
type helperStderr struct {
	mu    sync.Mutex
	buf   []byte
	last  string
	total func(int64)
	warn  func(string)
}

func (h *helperStderr) Write(b []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.buf = append(h.buf, b...)
	for {
		i := strings.IndexByte(string(h.buf), '\n')
		if i < 0 {
			if len(h.buf) > 4096 {
				h.buf = h.buf[len(h.buf)-4096:]
			}
			return len(b), nil
		}
		h.line(string(h.buf[:i]))
		h.buf = h.buf[i+1:]
	}
}

func (h *helperStderr) line(l string) {
	if n, ok := strings.CutPrefix(l, "total "); ok {
		if v, err := strconv.ParseInt(n, 10, 64); err == nil && h.total != nil {
			h.total(v)
		}
		return
	}
	if w, ok := strings.CutPrefix(l, "warning: "); ok {
		if h.warn != nil {
			h.warn(w)
		}
		return
	}
	h.last = l
}

func (h *helperStderr) flush() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.buf) > 0 {
		h.line(string(h.buf))
		h.buf = nil
	}
}

type limitedWriter struct {
	w io.Writer
	n int
}

func (l *limitedWriter) Write(b []byte) (int, error) {
	if l.n > 0 {
		m := min(len(b), l.n)
		l.w.Write(b[:m])
		l.n -= m
	}
	return len(b), nil
}
