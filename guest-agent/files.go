package agent

import (
	"archive/tar"
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Files: kvbox cp moves a tar stream (archive/tar, PAX) through an exec of
// the agent's own binary (runFilesHelper), so a copy gets exec's flow control,
// process-group abort and exit status, and the guest's side runs in its own
// process. WriteTree writes the stream on either side; the side that
// receives it extracts it: ExtractTree in the box, whose stream is the
// host's, and ExtractFromBox on the host, whose stream is a box's and so
// untrusted input (its rules are on ExtractFromBox).
//
// What a copy keeps: regular files, directories and symlinks (never
// followed, the top one included, as cp -a does), modification and access
// times, and permission bits: into a box with setuid/setgid/sticky, out of
// one without them and without group or world write. Not kept: owners
// (the extracting side, root on both, owns what it writes), hard links
// (each becomes its own file), xattrs/ACLs. Devices, fifos and sockets are
// skipped with a warning. Runs of zeroes are written as holes.
//
// Nothing half-written is left at the destination: a file is written under
// a temporary name next to its final one and renamed when complete; a new
// tree is built in a temporary directory beside its destination and
// renamed into place when complete, so it appears whole or not at all. A
// tree copied into a box onto an existing directory merges into it (as
// cp -r does): a failure then leaves the files completed so far, each
// whole, and none half-written. A tree out of a box never merges.

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
//
// The tree is walked from directory handles: each entry is looked at and
// opened relative to its directory's descriptor, never through a link
// (O_NOFOLLOW), so a user who may write to part of the tree cannot make
// the walk leave it by swapping a directory or a file for a link while it
// runs (kvbox cp runs as root). An entry that is swapped between the look
// and the open fails the copy; one swapped before the look is sent as
// what it then is (a link is sent as a link). Only src itself is found by
// its path, and its last component is not followed either.
func WriteTree(w io.Writer, src string, warn func(string)) error {
	src = filepath.Clean(src)
	top := filepath.Base(src)
	if top == "/" || top == "." {
		top = "root"
	}
	t := &treeWriter{tw: tar.NewWriter(w), buf: make([]byte, 1<<20), warn: warn}
	if err := t.entry(unix.AT_FDCWD, src, src, top, true); err != nil {
		return err
	}
	return t.tw.Close()
}

type treeWriter struct {
	tw   *tar.Writer
	buf  []byte
	warn func(string)
}

// entry writes name, relative to the directory dirfd, as the tar entry
// tarName and, for a directory, everything below it. p is its path, for
// messages.
func (t *treeWriter) entry(dirfd int, name, p, tarName string, top bool) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if top {
			return statError(p, err)
		}
		return fmt.Errorf("%s: %w", p, err)
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFLNK:
		link, err := readlinkat(dirfd, name)
		if err != nil {
			return changedError(p, "a symlink", err)
		}
		h := tarHeader(tarName, &st)
		h.Typeflag, h.Linkname = tar.TypeSymlink, link
		return t.tw.WriteHeader(h)
	case unix.S_IFDIR:
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return changedError(p, "a directory", err)
		}
		d := os.NewFile(uintptr(fd), p)
		defer d.Close()
		// The header is the opened directory's, not what the look saw.
		if err := unix.Fstat(fd, &st); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		h := tarHeader(tarName+"/", &st)
		h.Typeflag = tar.TypeDir
		if err := t.tw.WriteHeader(h); err != nil {
			return err
		}
		names, err := d.Readdirnames(-1)
		if err != nil {
			return fmt.Errorf("%s: %w", p, unwrapPath(err))
		}
		sort.Strings(names)
		for _, n := range names {
			if err := t.entry(fd, n, filepath.Join(p, n), tarName+"/"+n, false); err != nil {
				return err
			}
		}
		return nil
	case unix.S_IFREG:
		// O_NONBLOCK: a file swapped for a FIFO does not hang the open.
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			return changedError(p, "a file", err)
		}
		f := os.NewFile(uintptr(fd), p)
		defer f.Close()
		if err := unix.Fstat(fd, &st); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG {
			return fmt.Errorf("%s: changed while being copied (was a file)", p)
		}
		h := tarHeader(tarName, &st)
		h.Typeflag, h.Size = tar.TypeReg, st.Size
		if err := t.tw.WriteHeader(h); err != nil {
			return err
		}
		n, err := io.CopyBuffer(t.tw, io.LimitReader(f, h.Size), t.buf)
		if err != nil {
			return err
		}
		if n != h.Size {
			return fmt.Errorf("%s: shrank from %d to %d bytes while being copied", p, h.Size, n)
		}
		return nil
	default:
		if t.warn != nil {
			t.warn(fmt.Sprintf("skipped %s: a %s, not a file, directory or symlink", p, fileKind(modeType(st.Mode))))
		}
		return nil
	}
}

// tarHeader is the header of an entry of WriteTree: permission bits with
// setuid/setgid/sticky, times; no owner (the extracting side owns what it
// writes).
func tarHeader(name string, st *unix.Stat_t) *tar.Header {
	return &tar.Header{
		Name:       name,
		Mode:       int64(st.Mode & 0o7777),
		ModTime:    time.Unix(st.Mtim.Unix()),
		AccessTime: time.Unix(st.Atim.Unix()),
		Format:     tar.FormatPAX,
	}
}

func modeType(m uint32) fs.FileMode {
	switch m & unix.S_IFMT {
	case unix.S_IFIFO:
		return fs.ModeNamedPipe
	case unix.S_IFSOCK:
		return fs.ModeSocket
	case unix.S_IFBLK, unix.S_IFCHR:
		return fs.ModeDevice
	}
	return fs.ModeIrregular
}

// changedError is an open that found something else than the look did.
func changedError(p, was string, err error) error {
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("%s: changed while being copied (was %s)", p, was)
	}
	return fmt.Errorf("%s: %w", p, err)
}

func readlinkat(dirfd int, name string) (string, error) {
	for n := 256; ; n *= 2 {
		b := make([]byte, n)
		m, err := unix.Readlinkat(dirfd, name, b)
		if err != nil {
			return "", err
		}
		if m < n {
			return string(b[:m]), nil
		}
	}
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
// and puts that entry at dst, with cp's rules: into dst, under the name
// the stream gives it, when dst is an existing directory, else as dst
// (whose parent must exist); a tree onto an existing directory is merged
// into it. It returns the path it wrote. It trusts the stream (the
// guest's side of a copy into a box, whose stream is the host's);
// ExtractFromBox is the host's side of a copy out of a box.
func ExtractTree(r io.Reader, dst string) (string, error) {
	return extractTree(r, dst, nil)
}

// FromBox is how the host takes a copy out of a box: its stream is
// untrusted input, and the host decides every name and mode.
type FromBox struct {
	// Name is the copy's name in DST when DST is an existing directory:
	// the base name of the SRC the user typed. The name the stream gives
	// its top entry is never used.
	Name string
	// MaxBytes bounds what the copy may write: the sizes its files claim
	// (holes included) and 512 bytes for each entry. 0 is
	// DefaultMaxCopy.
	MaxBytes int64
	// Warn gets one line for each entry skipped; it may be nil.
	Warn func(string)
}

// DefaultMaxCopy is what a copy out of a box may write unless the user
// says otherwise: twice a new box's default disk.
const DefaultMaxCopy int64 = 16 << 30

// entryCost is what every entry of a copy out of a box counts towards
// its bound besides its size: a tar header's block, about what its inode
// and directory entry cost.
const entryCost = 512

// TooBigError is a copy out of a box that would write more than its
// bound (FromBox.MaxBytes).
type TooBigError struct {
	Limit int64
	At    string // the path whose entry passed the bound
}

func (e *TooBigError) Error() string {
	return fmt.Sprintf("%s: the copy would write more than %d bytes", e.At, e.Limit)
}

// ErrExists is wrapped when a tree out of a box would land on something
// that exists.
var ErrExists = errors.New("exists")

// maxTrailer is what a stream from a box may hold after its end: tar's
// padding to its record size.
const maxTrailer = 1 << 20

// maxWarnings is how many skipped entries of one copy are named; the
// rest are counted.
const maxWarnings = 10

// ExtractFromBox reads the stream of a copy out of a box (WriteTree's, in
// the box) from r and puts its top entry at dst: as dst/o.Name when dst is
// an existing directory, else as dst, whose parent must exist. It returns
// the path it wrote. The box is not trusted:
//
//   - The host names the copy (o.Name or dst); the box only supplies what
//     is below it. Every entry must be below the stream's first one, with
//     a plain relative name (no "..", no leading "/"), else the copy is
//     refused.
//   - A tree is never merged into, nor chmodded onto, an existing
//     directory: a tree whose name exists is refused, whatever its type.
//     A file replaces an existing file (the user named it), never a
//     directory.
//   - Modes keep read and execute bits and the owner's write bit: no
//     setuid, setgid or sticky bit, no group or world write. The owner is
//     whoever runs this (kvbox: root).
//   - Symlinks are kept only when they point inside the copy: relative,
//     with their ".." leading and no more of them than the link is deep.
//     Others are skipped with a warning; a copy that is only such a link
//     is refused. No entry may lie below a link of the stream.
//   - Hard links, devices, FIFOs and every other tar type are refused
//     (WriteTree never sends them).
//   - What the copy writes is bounded (o.MaxBytes): an entry that would
//     pass the bound is refused before its data is written. Runs of zeroes
//     are written as holes, so a sparse entry of a few KB writes a few KB.
//
// Whatever fails, nothing is left at dst: the copy is built in a
// temporary directory beside its destination (mode 0700) and renamed into
// place, a tree without replacing anything (RENAME_NOREPLACE).
func ExtractFromBox(r io.Reader, dst string, o FromBox) (string, error) {
	if o.Name == "" || o.Name == "." || o.Name == ".." || strings.ContainsRune(o.Name, '/') {
		return "", fmt.Errorf("the copy's name %q is not a file name", o.Name)
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxCopy
	}
	return extractTree(r, dst, &o)
}

// extractTree reads the tar stream r into dst: the stream's top entry is
// the copy (box: a copy from a box, checked as hostile input).
func extractTree(r io.Reader, dst string, box *FromBox) (string, error) {
	tr := tar.NewReader(r)
	h, top, err := topEntry(tr, box)
	if err != nil {
		return "", err
	}
	topDir := h.Typeflag == tar.TypeDir
	name := top
	if box != nil {
		name = box.Name
	}
	final, exists, err := destination(dst, name, topDir, box != nil)
	if err != nil {
		return "", err
	}
	if exists && topDir {
		return mergeInto(final, top, h, tr)
	}
	return extractNew(r, tr, h, final, top, box)
}

// topEntry reads the stream's first entry, which must be its top entry:
// one plain name (box: as WriteTree writes it), and no symlink from a box.
func topEntry(tr *tar.Reader, box *FromBox) (*tar.Header, string, error) {
	h, err := tr.Next()
	if err == io.EOF {
		return nil, "", errors.New("the copy's stream is empty")
	}
	if err != nil {
		return nil, "", fmt.Errorf("read the copy's stream: %w", err)
	}
	top, _, _ := strings.Cut(strings.TrimPrefix(path.Clean(h.Name), "/"), "/")
	if !filepath.IsLocal(top) || top == "." || path.Clean(h.Name) != top || (box != nil && !plainName(h.Name)) {
		return nil, "", fmt.Errorf("the copy's stream starts with %q, not its top entry", h.Name)
	}
	if box != nil && h.Typeflag == tar.TypeSymlink {
		return nil, "", fmt.Errorf("the copy is a symlink (to %q): kvbox cp writes no link from a box that points outside what it copies (copy what it points to, or kvbox cp BOX:SRC - | tar -x)", h.Linkname)
	}
	return h, top, nil
}

// destination is where the copy named name lands in dst, and whether
// something is there already: a directory a tree is merged into (never
// a tree from a box), or a file a file replaces.
func destination(dst, name string, topDir, fromBox bool) (string, bool, error) {
	final, err := resolveDest(dst, name, topDir)
	if err != nil {
		return "", false, err
	}
	fst, ferr := os.Lstat(final)
	exists := ferr == nil
	switch {
	case ferr != nil && !errors.Is(ferr, fs.ErrNotExist):
		return "", false, statError(final, ferr)
	case exists && topDir && fromBox:
		return "", false, fmt.Errorf("%s: %w: a tree from a box is never merged into what is on the host (remove it, or copy to a new name)", final, ErrExists)
	case exists && topDir && !fst.IsDir():
		return "", false, fmt.Errorf("%s: exists and is not a directory", final)
	case exists && !topDir && fst.IsDir():
		return "", false, fmt.Errorf("%s: is a directory (a file cannot replace it)", final)
	}
	return final, exists, nil
}

// mergeInto merges the tree whose top entry is h into the existing
// directory final, each file whole (a copy into a box only: the stream is
// the host's).
func mergeInto(final, top string, h *tar.Header, tr *tar.Reader) (string, error) {
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

// extractNew builds a new tree or a file under a temporary directory
// beside final, then renames it into place.
func extractNew(r io.Reader, tr *tar.Reader, h *tar.Header, final, top string, box *FromBox) (string, error) {
	parent := filepath.Dir(final)
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
	x := &extractor{root: root, base: tmp, strip: top, as: "t", shown: final}
	if box != nil {
		x.box, x.limit, x.warn, x.links = true, box.MaxBytes, box.Warn, map[string]bool{}
	}
	if err := x.run(h, tr); err != nil {
		return "", err
	}
	if box != nil {
		if err := readTrailer(r); err != nil {
			return "", err
		}
	}
	if err := putInPlace(filepath.Join(tmp, "t"), final, h.Typeflag == tar.TypeDir && box != nil); err != nil {
		return "", err
	}
	return final, nil
}

// readTrailer reads a box's stream to its end before its copy is put in
// place: a box's side that fails after the last entry leaves nothing, and
// the zeroes tar pads a stream with to its record size (GNU tar: 10 KiB)
// are taken. More than maxTrailer after the end is refused.
func readTrailer(r io.Reader) error {
	n, err := io.Copy(io.Discard, io.LimitReader(r, maxTrailer+1))
	if err != nil {
		return fmt.Errorf("read the copy's stream: %w", err)
	}
	if n > maxTrailer {
		return fmt.Errorf("the copy's stream goes on for more than %d bytes after its end", maxTrailer)
	}
	return nil
}

// putInPlace renames from to final; a tree from a box (noReplace) never
// replaces what appeared at final meanwhile (RENAME_NOREPLACE).
func putInPlace(from, final string, noReplace bool) error {
	var err error
	if noReplace {
		err = unix.Renameat2(unix.AT_FDCWD, from, unix.AT_FDCWD, final, unix.RENAME_NOREPLACE)
		if errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("%s: %w: a tree from a box is never merged into what is on the host (remove it, or copy to a new name)", final, ErrExists)
		}
	} else {
		err = os.Rename(from, final)
	}
	if err != nil {
		return fmt.Errorf("put %s in place: %w", final, unwrapPath(err))
	}
	return nil
}

// plainName reports a tar entry name as WriteTree writes them: relative,
// no ".", ".." or empty component (a directory's trailing "/" aside).
func plainName(name string) bool {
	n := strings.TrimSuffix(name, "/")
	return filepath.IsLocal(n) && path.Clean(n) == n
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
	shown string        // when set, the path as stands for in messages
	dirs  []*tar.Header // directories, their modes and times set last
	buf   []byte

	// box: the stream comes from a box (ExtractFromBox's rules).
	box    bool
	limit  int64 // the most the copy may write
	used   int64
	warn   func(string)
	warned int
	links  map[string]bool // the symlinks written so far, by rel
}

func (x *extractor) rel(name string) (string, error) {
	if x.box && !plainName(name) {
		return "", fmt.Errorf("the copy's stream names %q, not a plain path below its top entry", name)
	}
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

// path is where rel will be once the copy is in place, for messages.
func (x *extractor) path(rel string) string {
	if x.shown != "" && x.as != "" {
		if rel == x.as {
			return x.shown
		}
		if rest, ok := strings.CutPrefix(rel, x.as+"/"); ok {
			return filepath.Join(x.shown, rest)
		}
	}
	return filepath.Join(x.base, rel)
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
	if n := x.warned - maxWarnings; n > 0 && x.warn != nil {
		x.warn(fmt.Sprintf("skipped %d more symlinks pointing outside the copy", n))
	}
	// Deepest first, so setting a directory's time is the last change in it.
	for i := len(x.dirs) - 1; i >= 0; i-- {
		h := x.dirs[i]
		rel, _ := x.rel(h.Name)
		if err := x.root.Chmod(rel, x.mode(h)); err != nil {
			return err
		}
		if err := x.root.Chtimes(rel, atime(h), h.ModTime); err != nil {
			return err
		}
	}
	return nil
}

// mode is the mode an entry is given: the stream's, with setuid, setgid
// and sticky; from a box, read and execute bits and the owner's write
// bit only. A box's file lands in the group of whoever runs kvbox (root's
// on a host), which the box knows nothing of: group write would let that
// group's members change a file root may later run, as world write would
// let anyone.
func (x *extractor) mode(h *tar.Header) fs.FileMode {
	m := h.FileInfo().Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	if x.box {
		m &= 0o755
	}
	return m
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

// check applies a box's rules to an entry before anything of it is
// written: not below a link, within the copy's bound.
func (x *extractor) check(h *tar.Header, rel string) error {
	for p := path.Dir(rel); p != "." && p != "/"; p = path.Dir(p) {
		if x.links[p] {
			return fmt.Errorf("the copy's stream puts %q below a symlink it holds", h.Name)
		}
	}
	size := int64(0)
	if h.Typeflag == tar.TypeReg || h.Typeflag == tar.TypeGNUSparse {
		size = max(h.Size, 0)
	}
	if size > x.limit || x.used+size+entryCost > x.limit {
		return &TooBigError{Limit: x.limit, At: x.path(rel)}
	}
	x.used += size + entryCost
	return nil
}

// linkInside reports whether a symlink depth directories below the
// copy's top that points to target stays inside the copy when followed:
// target is relative, its ".." components all lead (a ".." after a name
// would climb from wherever that name, itself perhaps a link, leads) and
// climb no higher than the top. With no entry below a link, every link of
// the copy obeying this keeps every path through links inside it.
func linkInside(depth int, target string) bool {
	if target == "" || strings.HasPrefix(target, "/") {
		return false
	}
	up, named := 0, false
	for _, c := range strings.Split(target, "/") {
		switch c {
		case "", ".":
		case "..":
			if named {
				return false
			}
			up++
		default:
			named = true
		}
	}
	return up <= depth
}

func (x *extractor) entry(h *tar.Header, tr *tar.Reader) error {
	rel, err := x.rel(h.Name)
	if err != nil {
		return err
	}
	if x.box {
		if err := x.check(h, rel); err != nil {
			return err
		}
	}
	switch h.Typeflag {
	case tar.TypeDir:
		return x.dir(h, rel)
	case tar.TypeReg, tar.TypeGNUSparse:
		return x.file(h, tr, rel)
	case tar.TypeSymlink:
		return x.symlink(h, rel)
	default:
		// Hard links, devices, fifos: WriteTree never sends them.
		return fmt.Errorf("the copy's stream holds %q of tar type %q, which kvbox cp does not copy", h.Name, h.Typeflag)
	}
}

// dir makes directory rel unless it is there; its mode and times are set
// at the end (x.dirs).
func (x *extractor) dir(h *tar.Header, rel string) error {
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
			return fmt.Errorf("%s: exists and is not a directory", x.path(rel))
		}
	}
	x.dirs = append(x.dirs, h)
	return nil
}

// file writes file rel whole: written beside it with its holes, mode and
// times, then renamed over it.
func (x *extractor) file(h *tar.Header, tr *tar.Reader, rel string) error {
	if st, err := x.root.Lstat(rel); err == nil && st.IsDir() {
		return fmt.Errorf("%s: is a directory (a file cannot replace it)", x.path(rel))
	}
	tmp := tmpName(rel)
	f, err := x.root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = writeHoles(f, tr, h.Size, x.buf)
	if err == nil {
		err = f.Chmod(x.mode(h))
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
		return fmt.Errorf("write %s: %w", x.path(rel), unwrapPath(err))
	}
	delete(x.links, rel)
	return nil
}

// symlink writes symlink rel (made beside it, then renamed over it); a box's
// symlink that points outside the copy is skipped with a warning.
func (x *extractor) symlink(h *tar.Header, rel string) error {
	if x.box {
		depth := strings.Count(rel, "/") - 1 // rel is "t/…/name"
		if !linkInside(depth, h.Linkname) {
			x.warned++
			if x.warned <= maxWarnings && x.warn != nil {
				x.warn(fmt.Sprintf("skipped %s: a symlink to %q, outside the copy", x.path(rel), h.Linkname))
			}
			return nil
		}
	}
	if st, err := x.root.Lstat(rel); err == nil && st.IsDir() {
		return fmt.Errorf("%s: is a directory (a symlink cannot replace it)", x.path(rel))
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
	if x.links != nil {
		x.links[rel] = true
	}
	return nil
}

// holeBlock is the unit writeHoles looks for zeroes in: a filesystem
// block.
const holeBlock = 4096

var zeroBlock [holeBlock]byte

// writeHoles writes the size bytes of r to the empty file f, leaving each
// block of zeroes a hole (seeking past it, as cp --sparse=always does):
// a sparse tar entry, whose holes a tar reader returns as zeroes, writes
// only its data, and so does any run of zeroes in a file. A stream that
// ends early is an error.
func writeHoles(f *os.File, r io.Reader, size int64, buf []byte) error {
	var off int64
	for off < size {
		n, err := io.ReadFull(r, buf[:min(int64(len(buf)), size-off)])
		b := buf[:n]
		for i := 0; i < len(b); {
			j := min(i+holeBlock, len(b))
			if bytes.Equal(b[i:j], zeroBlock[:j-i]) {
				i = j
				continue
			}
			k := j
			for k < len(b) {
				e := min(k+holeBlock, len(b))
				if bytes.Equal(b[k:e], zeroBlock[:e-k]) {
					break
				}
				k = e
			}
			if _, werr := f.WriteAt(b[i:k], off+int64(i)); werr != nil {
				return werr
			}
			i = k
		}
		off += int64(n)
		if err != nil {
			if err == io.EOF || err == io.ErrUnexpectedEOF {
				return fmt.Errorf("the copy's stream ends %d bytes into a file of %d: %w", off, size, io.ErrUnexpectedEOF)
			}
			return err
		}
	}
	return f.Truncate(size)
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
