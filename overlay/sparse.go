package overlay

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

const (
	zeroPage  = 4096    // granularity of the all-zero test: a guest page
	copyChunk = 1 << 20 // bytes read per step inside a data extent
)

// useCopyFileRange lets tests exercise the plain write fallback.
var useCopyFileRange = true

// CopySparse copies src to dst (created or truncated, with src's permission
// bits), keeping holes, and fsyncs dst. It first tries a reflink (FICLONE),
// which shares every block and copies nothing. Otherwise it walks src's data
// extents with SEEK_DATA/SEEK_HOLE and, inside each, leaves out every
// all-zero 4 KiB page: QEMU's RAM file has pages that are allocated but zero,
// and they need no disk in the copy. Non-zero runs go through
// copy_file_range (the kernel may share blocks or copy server-side) and fall
// back to writing the bytes already read. written counts the bytes copied
// into dst (0 for a reflink). dst has src's size.
func CopySparse(dst, src string) (written int64, err error) {
	in, err := os.Open(src)
	if err != nil {
		return 0, err
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return 0, err
	}
	if !st.Mode().IsRegular() {
		return 0, fmt.Errorf("overlay: copy %s: not a regular file", src)
	}
	if dst, err := os.Stat(dst); err == nil && os.SameFile(st, dst) {
		return 0, fmt.Errorf("overlay: copy %s: source and destination are the same file", src)
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, st.Mode().Perm())
	if err != nil {
		return 0, err
	}
	defer func() {
		if cerr := out.Close(); err == nil && cerr != nil {
			err = cerr
		}
	}()

	written, err = CopyFileSparse(out, in)
	if err != nil {
		return written, fmt.Errorf("overlay: copy %s to %s: %w", src, dst, err)
	}
	if err := out.Sync(); err != nil {
		return written, fmt.Errorf("overlay: fsync %s: %w", dst, err)
	}
	return written, nil
}

// CopyFileSparse is CopySparse on open files (out empty), without the
// fsync: for a caller that opened them itself (not following links).
func CopyFileSparse(out, in *os.File) (written int64, err error) {
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return 0, nil
	}
	// The clone failed (EOPNOTSUPP, EXDEV, EINVAL on ext4/tmpfs ...); out
	// is still empty.
	st, err := in.Stat()
	if err != nil {
		return 0, err
	}
	size := st.Size()
	if err := out.Truncate(size); err != nil {
		return 0, err
	}
	return copyExtents(out, in, size)
}

// copyExtents copies the data extents of in to out, skipping holes and
// leaving pages that are all zero unwritten, so out is as sparse as in's
// data allows.
//
// The extents are all found before the first read: a read makes the kernel
// read ahead past its range, and in a file whose blocks are reserved
// (unwritten extents: a box's RAM file) the pages read ahead turn the hole
// after an extent into data for SEEK_DATA, so a walk that seeks as it reads
// goes on reading ahead into the next hole, and the next, to the end.
func copyExtents(out, in *os.File, size int64) (int64, error) {
	return CopyRangeSparse(out, in, 0, size)
}

// CopyRangeSparse copies n bytes of in from inOff to out at 0: only in's
// data extents (all found before the first read, see copyExtents), and of
// those only the pages that are not all zero; out's bytes elsewhere are
// left as they are.
func CopyRangeSparse(out, in *os.File, inOff, n int64) (int64, error) {
	x := &extentCopy{in: in, out: out, buf: make([]byte, copyChunk), zeros: make([]byte, zeroPage), cfr: useCopyFileRange, shift: inOff}
	data, _, err := DataExtents(in)
	if err != nil {
		return 0, err
	}
	for _, e := range data {
		pos, end := max(e.Off, inOff), min(e.Off+e.Len, inOff+n)
		if pos >= end {
			continue
		}
		if err := x.extent(pos, end); err != nil {
			return x.written, err
		}
	}
	return x.written, nil
}

// extentCopy is one sparse copy in progress.
type extentCopy struct {
	in, out    *os.File
	buf, zeros []byte
	cfr        bool  // copy_file_range still works between the two files
	shift      int64 // a byte at off in in goes to off-shift in out
	written    int64
}

// extent copies the data extent [pos, end) chunk by chunk, each chunk as
// its runs of pages that are not all zero.
func (x *extentCopy) extent(pos, end int64) error {
	for pos < end {
		chunk := x.buf[:min(int64(len(x.buf)), end-pos)]
		if _, err := x.in.ReadAt(chunk, pos); err != nil {
			if errors.Is(err, io.EOF) {
				err = fmt.Errorf("%s shrank during the copy: %w", x.in.Name(), io.ErrUnexpectedEOF)
			}
			return err
		}
		runStart := -1
		for p := 0; p < len(chunk); p += zeroPage {
			e := min(p+zeroPage, len(chunk))
			isZero := bytes.Equal(chunk[p:e], x.zeros[:e-p])
			if !isZero && runStart < 0 {
				runStart = p
			}
			if isZero && runStart >= 0 {
				if err := x.run(pos+int64(runStart), chunk[runStart:p]); err != nil {
					return err
				}
				runStart = -1
			}
		}
		if runStart >= 0 {
			if err := x.run(pos+int64(runStart), chunk[runStart:]); err != nil {
				return err
			}
		}
		pos += int64(len(chunk))
	}
	return nil
}

// run writes one run of data at off: with copy_file_range (which shares
// blocks where the filesystem can), else from the bytes read.
func (x *extentCopy) run(off int64, data []byte) error {
	inFd, outFd := int(x.in.Fd()), int(x.out.Fd())
	for x.cfr && len(data) > 0 {
		roff, woff := off, off-x.shift
		n, err := unix.CopyFileRange(inFd, &roff, outFd, &woff, len(data), 0)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			// Not supported between these files: write the bytes.
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOSYS) ||
				errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EINVAL) {
				x.cfr = false
				break
			}
			return err
		}
		if n == 0 {
			x.cfr = false // src shrank under us; let WriteAt report it
			break
		}
		x.written += int64(n)
		off += int64(n)
		data = data[n:]
	}
	if len(data) == 0 {
		return nil
	}
	n, err := x.out.WriteAt(data, off-x.shift)
	x.written += int64(n)
	return err
}

// DataBytes is how much of f SEEK_DATA calls data (see DataExtents). For a
// box's RAM file, whose blocks are reserved, that is what the guest wrote
// plus the pages in the page cache.
func DataBytes(f *os.File) (int64, error) {
	data, _, err := DataExtents(f)
	var n int64
	for _, e := range data {
		n += e.Len
	}
	return n, err
}

// Extent is a byte range of a file.
type Extent struct{ Off, Len int64 }

// DataExtents returns the data extents of f, found with SEEK_DATA and
// SEEK_HOLE (so no page of it is read), and its size: the whole file where
// the filesystem does not report holes.
func DataExtents(f *os.File) ([]Extent, int64, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	size := st.Size()
	var out []Extent
	fd := int(f.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			if len(out) == 0 && off == 0 { // no SEEK_DATA: all data
				return []Extent{{0, size}}, size, nil
			}
			return nil, 0, err
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, 0, err
		}
		if hole > size {
			hole = size
		}
		out = append(out, Extent{data, hole - data})
		off = hole
	}
	return out, size, nil
}
