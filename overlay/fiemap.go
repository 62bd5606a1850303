package overlay

import (
	"encoding/binary"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// FIEMAP (linux/fiemap.h); golang.org/x/sys has neither the ioctl nor its
// structs.
const (
	fsIocFiemap       = 0xc020660b // _IOWR('f', 11, struct fiemap)
	fiemapHeader      = 32         // struct fiemap without its extents
	fiemapExtentSize  = 56         // struct fiemap_extent
	fiemapExtentLast  = 0x1
	fiemapUnwritten   = 0x800
	fiemapExtentBatch = 256
)

// UnwrittenRanges returns the ranges of f that hold no data written to
// disk: its holes and its preallocated (unwritten) extents, from the
// filesystem's extent map (FIEMAP, without syncing the file first). In
// such a range a clean page of the page cache can only be a page of zeros
// that a read put there: a page written to disk would have made its
// extent written. ok is false where the filesystem has no FIEMAP.
func UnwrittenRanges(f *os.File) (out []Extent, ok bool, err error) {
	st, err := f.Stat()
	if err != nil {
		return nil, false, err
	}
	size := st.Size()
	buf := make([]byte, fiemapHeader+fiemapExtentBatch*fiemapExtentSize)
	le := binary.LittleEndian     // the kernel's layout on the hosts kvbox runs on (x86-64, arm64)
	at := int64(0)                // end of the extent map read so far
	add := func(off, end int64) { // merges with the range before
		if end <= off {
			return
		}
		if n := len(out); n > 0 && out[n-1].Off+out[n-1].Len == off {
			out[n-1].Len = end - out[n-1].Off
			return
		}
		out = append(out, Extent{off, end - off})
	}
	for at < size {
		clear(buf)
		le.PutUint64(buf[0:], uint64(at))
		le.PutUint64(buf[8:], uint64(size-at))
		le.PutUint32(buf[24:], fiemapExtentBatch)
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fsIocFiemap, uintptr(unsafe.Pointer(&buf[0]))); errno != 0 {
			if errno == unix.EOPNOTSUPP || errno == unix.ENOTTY {
				return nil, false, nil
			}
			return nil, false, errno
		}
		n := int(le.Uint32(buf[20:]))
		if n == 0 {
			break
		}
		last := false
		for i := range n {
			e := buf[fiemapHeader+i*fiemapExtentSize:]
			off, length, flags := int64(le.Uint64(e[0:])), int64(le.Uint64(e[16:])), le.Uint32(e[40:])
			off, end := max(off, at), min(off+length, size)
			add(at, off) // a hole
			if flags&fiemapUnwritten != 0 {
				add(off, end)
			}
			at = max(at, end)
			last = last || flags&fiemapExtentLast != 0
		}
		if last {
			break
		}
	}
	add(at, size) // the hole at the end
	return out, true, nil
}
