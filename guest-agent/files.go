package agent

import (
	"archive/tar"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Files: kvbox cp moves a tar stream (archive/tar, PAX) through an exec of
// the agent's own binary (FilesHelper), so a copy gets exec's flow control,
// process-group abort and exit status, and the guest's side runs in its own
// process. Both ends use WriteTree and ExtractTree: the same rules whichever
// way a copy goes.
//
// What a copy keeps: regular files, directories and symlinks (never
// followed, the top one included, as cp -a does), permission bits with
// setuid/setgid/sticky, modification and access times. Not kept: owners
// (the extracting side, root on both, owns what it writes), hard links
// (each becomes its own file), xattrs/ACLs. Devices, fifos and sockets are
// skipped with a warning.
//
// Nothing half-written is left at the destination: a file is written under
// a temporary name next to its final one and renamed when complete; a new
// tree is built in a temporary directory beside its destination and
// renamed into place when complete, so it appears whole or not at all. A
// tree copied onto an existing directory merges into it (as cp -r does):
// a failure then leaves the files completed so far, each whole, and none
// half-written.

func init() { registerFeature(FeatureFiles) }

// FilesHelperArg is argv[1] of the agent binary run as the file helper.
const FilesHelperArg = "files-helper"

// selfArgv0 in an exec request's argv[0] runs the agent's own binary. An
// agent that predates FeatureFiles looks it up in PATH and fails with
// "not found" (a host asks for the feature first).
const selfArgv0 = "kvbox-agent:self"

// Exit codes of the file helper.
const (
	filesExitFailed   = 1
	filesExitNotFound = 3
	filesExitUsage    = 2
)

// tmpPrefix starts every temporary name a copy makes.
const tmpPrefix = ".kvbox-cp-"

// ErrPathNotFound is wrapped when a copy's source, or its destination's
// directory, does not exist.
var ErrPathNotFound = errors.New("no such file or directory")

// TreeSize sums the bytes of the regular files under src (not following
// links): the total a progress line counts towards.
func TreeSize(src string) (files int, bytes int64, err error) {
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			files++
			bytes += fi.Size()
		}
		return nil
	})
	return files, bytes, err
}

// WriteTree writes src (a file, a directory tree or a symlink) to w as a
// tar stream whose entries are named under src's base name. warn receives
// one line per skipped entry; it may be nil.
func WriteTree(w io.Writer, src string, warn func(string)) error {
	src = filepath.Clean(src)
	if _, err := os.Lstat(src); err != nil {
		return statError(src, err)
	}
	top := filepath.Base(src)
	if top == "/" || top == "." {
		top = "root"
	}
	tw := tar.NewWriter(w)
	buf := make([]byte, 1<<20)
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		name := path.Join(top, filepath.ToSlash(rel))
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		case fi.Mode().IsRegular(), fi.IsDir():
		default:
			if warn != nil {
				warn(fmt.Sprintf("skipped %s: a %s, not a file, directory or symlink", p, fileKind(fi.Mode())))
			}
			return nil
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name = name
		if fi.IsDir() {
			h.Name += "/"
		}
		h.Format = tar.FormatPAX
		h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
		h.ChangeTime = time.Time{}
		if st, ok := fi.Sys().(*unix.Stat_t); ok {
			h.AccessTime = time.Unix(st.Atim.Unix())
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return nil
		}
		f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		n, err := io.CopyBuffer(tw, io.LimitReader(f, h.Size), buf)
		if err != nil {
			return err
		}
		if n != h.Size {
			return fmt.Errorf("%s: shrank from %d to %d bytes while being copied", p, h.Size, n)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

func fileKind(m fs.FileMode) string {
	switch {
	case m&fs.ModeNamedPipe != 0:
		return "fifo"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m&fs.ModeDevice != 0:
		return "device"
	}
	return "special file"
}

func statError(p string, err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s: %w", p, ErrPathNotFound)
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return fmt.Errorf("%s: %w", p, pe.Err)
	}
	return err
}

// ExtractTree reads a tar stream made by WriteTree (one top entry) from r
// and puts that entry at dst, with cp's rules: into dst when dst is an
// existing directory, else as dst (whose parent must exist). It returns
// the path it wrote.
func ExtractTree(r io.Reader, dst string) (string, error) {
	tr := tar.NewReader(r)
	h, err := tr.Next()
	if err == io.EOF {
		return "", errors.New("the copy's stream is empty")
	}
	if err != nil {
		return "", fmt.Errorf("read the copy's stream: %w", err)
	}
	top, _, _ := strings.Cut(strings.TrimPrefix(path.Clean(h.Name), "/"), "/")
	if !filepath.IsLocal(top) || top == "." || path.Clean(h.Name) != top {
		return "", fmt.Errorf("the copy's stream starts with %q, not its top entry", h.Name)
	}
	topDir := h.Typeflag == tar.TypeDir

	final, err := resolveDest(dst, top, topDir)
	if err != nil {
		return "", err
	}
	parent := filepath.Dir(final)
	fst, ferr := os.Lstat(final)
	exists := ferr == nil
	switch {
	case ferr != nil && !errors.Is(ferr, fs.ErrNotExist):
		return "", statError(final, ferr)
	case exists && topDir && !fst.IsDir():
		return "", fmt.Errorf("%s: exists and is not a directory", final)
	case exists && !topDir && fst.IsDir():
		return "", fmt.Errorf("%s: is a directory (a file cannot replace it)", final)
	}

	if exists && topDir {
		// Merge into the existing directory, each file whole.
		root, err := os.OpenRoot(final)
		if err != nil {
			return "", statError(final, err)
		}
		defer root.Close()
		x := &extractor{root: root, base: final, strip: top}
		if err := x.run(h, tr); err != nil {
			return "", err
		}
		return final, nil
	}
	// A new tree or a file: build it under a temporary directory beside
	// final, then rename it into place.
	tmp, err := os.MkdirTemp(parent, tmpPrefix)
	if err != nil {
		return "", statError(parent, errors.Unwrap(err))
	}
	defer os.RemoveAll(tmp)
	root, err := os.OpenRoot(tmp)
	if err != nil {
		return "", err
	}
	defer root.Close()
	x := &extractor{root: root, base: tmp, strip: top, as: "t"}
	if err := x.run(h, tr); err != nil {
		return "", err
	}
	if err := os.Rename(filepath.Join(tmp, "t"), final); err != nil {
		return "", fmt.Errorf("put %s in place: %w", final, err)
	}
	return final, nil
}

// ExtractStream reads any tar stream (kvbox cp - BOX:DIR) into the existing
// directory dst, merging; each file lands whole.
func ExtractStream(r io.Reader, dst string) error {
	st, err := os.Stat(dst)
	if err != nil {
		return statError(dst, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("%s: not a directory", dst)
	}
	root, err := os.OpenRoot(dst)
	if err != nil {
		return statError(dst, err)
	}
	defer root.Close()
	tr := tar.NewReader(r)
	h, err := tr.Next()
	if err == io.EOF {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read the tar stream: %w", err)
	}
	x := &extractor{root: root, base: dst}
	return x.run(h, tr)
}

// resolveDest applies cp's rules to a destination.
func resolveDest(dst, top string, topDir bool) (string, error) {
	st, err := os.Stat(dst)
	if err == nil && st.IsDir() {
		return filepath.Join(dst, top), nil
	}
	if err == nil {
		if topDir {
			return "", fmt.Errorf("%s: not a directory", dst)
		}
		return filepath.Clean(dst), nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		var pe *fs.PathError
		if errors.As(err, &pe) && errors.Is(pe.Err, unix.ENOTDIR) {
			// Name the component that is a file.
			p := filepath.Clean(dst)
			for q := filepath.Dir(p); q != p; p, q = q, filepath.Dir(q) {
				if st, err := os.Stat(q); err == nil && !st.IsDir() {
					return "", fmt.Errorf("%s: not a directory", q)
				}
			}
			return "", fmt.Errorf("%s: not a directory", dst)
		}
		return "", statError(dst, err)
	}
	if strings.HasSuffix(dst, "/") {
		return "", fmt.Errorf("%s: %w", dst, ErrPathNotFound)
	}
	parent := filepath.Dir(filepath.Clean(dst))
	pst, err := os.Stat(parent)
	if err != nil {
		return "", statError(parent, err)
	}
	if !pst.IsDir() {
		return "", fmt.Errorf("%s: not a directory", parent)
	}
	return filepath.Clean(dst), nil
}

// extractor writes tar entries below root, which no entry and no symlink
// can escape (os.Root).
type extractor struct {
	root *os.Root
	base string // root's path, for symlink times and messages
	// strip, when set, is the top entry's name: entries must be it or
	// below it, and it is written as as ("" meaning root itself).
	strip string
	as    string
	dirs  []*tar.Header // directories, their modes and times set last
	buf   []byte
}

func (x *extractor) rel(name string) (string, error) {
	n := path.Clean(strings.TrimPrefix(name, "/"))
	if !filepath.IsLocal(n) {
		return "", fmt.Errorf("the copy's stream names %q, outside the destination", name)
	}
	if x.strip == "" {
		return n, nil
	}
	if n == x.strip {
		if x.as == "" {
			return ".", nil
		}
		return x.as, nil
	}
	rest, ok := strings.CutPrefix(n, x.strip+"/")
	if !ok {
		return "", fmt.Errorf("the copy's stream names %q, outside its top entry %q", name, x.strip)
	}
	if x.as == "" {
		return rest, nil
	}
	return path.Join(x.as, rest), nil
}

func (x *extractor) run(h *tar.Header, tr *tar.Reader) error {
	x.buf = make([]byte, 1<<20)
	for {
		if err := x.entry(h, tr); err != nil {
			return err
		}
		var err error
		h, err = tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("read the copy's stream: %w", err)
		}
	}
	// Deepest first, so setting a directory's time is the last change in it.
	for i := len(x.dirs) - 1; i >= 0; i-- {
		h := x.dirs[i]
		rel, _ := x.rel(h.Name)
		if err := x.root.Chmod(rel, h.FileInfo().Mode()&(fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)); err != nil {
			return err
		}
		if err := x.root.Chtimes(rel, atime(h), h.ModTime); err != nil {
			return err
		}
	}
	return nil
}

func atime(h *tar.Header) time.Time {
	if h.AccessTime.IsZero() {
		return h.ModTime
	}
	return h.AccessTime
}

// tmpName is a temporary name beside rel.
func tmpName(rel string) string {
	var b [6]byte
	rand.Read(b[:])
	return path.Join(path.Dir(rel), fmt.Sprintf("%s%x-%s", tmpPrefix, b, path.Base(rel)))
}

func (x *extractor) entry(h *tar.Header, tr *tar.Reader) error {
	rel, err := x.rel(h.Name)
	if err != nil {
		return err
	}
	mode := h.FileInfo().Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	switch h.Typeflag {
	case tar.TypeDir:
		if rel != "." {
			st, err := x.root.Lstat(rel)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				// Owner-writable until its own mode is set at the end.
				if err := x.root.Mkdir(rel, 0o700); err != nil {
					return err
				}
			case err != nil:
				return err
			case !st.IsDir():
				return fmt.Errorf("%s: exists and is not a directory", filepath.Join(x.base, rel))
			}
		}
		x.dirs = append(x.dirs, h)
	case tar.TypeReg, tar.TypeRegA:
		if st, err := x.root.Lstat(rel); err == nil && st.IsDir() {
			return fmt.Errorf("%s: is a directory (a file cannot replace it)", filepath.Join(x.base, rel))
		}
		tmp := tmpName(rel)
		f, err := x.root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		_, err = io.CopyBuffer(f, tr, x.buf)
		if err == nil {
			err = f.Chmod(mode)
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			err = x.root.Chtimes(tmp, atime(h), h.ModTime)
		}
		if err == nil {
			err = x.root.Rename(tmp, rel)
		}
		if err != nil {
			x.root.Remove(tmp)
			return fmt.Errorf("write %s: %w", filepath.Join(x.base, rel), unwrapPath(err))
		}
	case tar.TypeSymlink:
		if st, err := x.root.Lstat(rel); err == nil && st.IsDir() {
			return fmt.Errorf("%s: is a directory (a symlink cannot replace it)", filepath.Join(x.base, rel))
		}
		tmp := tmpName(rel)
		if err := x.root.Symlink(h.Linkname, tmp); err != nil {
			return err
		}
		// os.Root has no lutimes: the link's own times through its full
		// path, not following it (every directory above it is one this
		// copy made or the destination itself).
		ts := []unix.Timespec{unix.NsecToTimespec(atime(h).UnixNano()), unix.NsecToTimespec(h.ModTime.UnixNano())}
		unix.UtimesNanoAt(unix.AT_FDCWD, filepath.Join(x.base, tmp), ts, unix.AT_SYMLINK_NOFOLLOW)
		if err := x.root.Rename(tmp, rel); err != nil {
			x.root.Remove(tmp)
			return err
		}
	default:
		// Hard links, devices, fifos: WriteTree never sends them.
		return fmt.Errorf("the copy's stream holds %q of tar type %q, which kvbox cp does not copy", h.Name, h.Typeflag)
	}
	return nil
}

func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		return le.Err
	}
	return err
}
