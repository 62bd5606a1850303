package vmstate

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
)

// ramBlockID is the id of the box's RAM block in QEMU's migration stream:
// the memory-backend-file object kvbox adds is named kvbox.ram.
const ramBlockID = domain.RAMBackendID

// mappedRAMHeader is QEMU's MappedRamHeader (migration/ram.c, QEMU >= 9.0),
// written big-endian and packed right after a RAM block's id and length
// when the mapped-ram capability is on. The offsets are absolute in the file.
type mappedRAMHeader struct {
	Version      uint32
	PageSize     uint64
	BitmapOffset uint64
	PagesOffset  uint64
}

const mappedRAMHeaderSize = 4 + 8 + 8 + 8

// PrepareMapped readies a state file written with mapped-ram for clones
// to map: it finds kvbox.ram's block, zeroes its page bitmap so that loading
// the state reads no page (the clone maps the pages from the file instead,
// privately, at the returned offset), and returns that offset. A file it
// readied already is left as it is (its bitmap is all zero, which no
// guest's saved RAM has).
func PrepareMapped(path string, ramSize int64) (int64, error) {
	f, err := domain.OpenNoFollow(path, os.O_RDWR) // QEMU wrote it: a plain file of its own, never a link
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	h, err := findRAMBlock(f, ramSize, fi.Size())
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	pages := (uint64(ramSize) + h.PageSize - 1) / h.PageSize
	bitmapBytes := (pages + 63) / 64 * 8 // BITS_TO_LONGS(pages) * sizeof(long)
	if h.BitmapOffset+bitmapBytes > h.PagesOffset {
		return 0, fmt.Errorf("%s: mapped-ram bitmap overlaps the pages", path)
	}
	bitmap := make([]byte, bitmapBytes)
	if _, err := f.ReadAt(bitmap, int64(h.BitmapOffset)); err != nil {
		return 0, fmt.Errorf("%s: read the mapped-ram bitmap: %w", path, err)
	}
	if bytes.Count(bitmap, []byte{0}) == len(bitmap) {
		// Readied already (a resume killed after it): no running guest's
		// RAM is all zeros, and punching now would zero every page.
		return int64(h.PagesOffset), nil
	}
	if err := punchUnsentPages(f, bitmap, pages, h); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	if _, err := f.WriteAt(make([]byte, bitmapBytes), int64(h.BitmapOffset)); err != nil {
		return 0, err
	}
	return int64(h.PagesOffset), f.Sync()
}

// punchUnsentPages makes every page whose bitmap bit is clear read as
// zeros in the file. A loader reads only the pages whose bit is set and
// leaves the others zero; a clone maps the file instead, so it must see the
// same. A live copy breaks that: a page sent in one pass that is all zero by
// a later one only has its bit cleared (QEMU's save_zero_page with
// mapped-ram), and its old bytes stay in the file. A guest zeroes freed
// pages all the time, so without this a clone of a live snapshot could map
// stale memory. Runs of clear bits become holes.
func punchUnsentPages(f *os.File, bitmap []byte, pages uint64, h mappedRAMHeader) error {
	// Only where the file holds data: a run of clear bits is mostly a
	// hole already (pages never sent), and a punch per run is slow
	// (docs/design.md#live-copy-of-ram).
	data, _, err := overlay.DataExtents(f)
	if err != nil {
		return err
	}
	punch := func(off, end int64) error {
		for len(data) > 0 && data[0].Off+data[0].Len <= off {
			data = data[1:]
		}
		for _, e := range data {
			if e.Off >= end {
				break
			}
			from, to := max(off, e.Off), min(end, e.Off+e.Len)
			if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, from, to-from); err != nil {
				return err
			}
		}
		return nil
	}
	set := func(i uint64) bool { return bitmap[i/8]&(1<<(i%8)) != 0 } // unsigned longs, little-endian
	for i := uint64(0); i < pages; {
		if set(i) {
			i++
			continue
		}
		j := i
		for j < pages && !set(j) {
			j++
		}
		off, n := int64(h.PagesOffset+i*h.PageSize), int64((j-i)*h.PageSize)
		if err := punch(off, off+n); err != nil {
			return fmt.Errorf("punch the unsent pages %d..%d: %w", i, j, err)
		}
		i = j
	}
	return nil
}

// findRAMBlock locates kvbox.ram's mapped-ram header in the head of a
// migration stream: the id (length-prefixed), its used length, the header.
// It reads the head in growing windows up to 16 MiB: the header sits in the
// first hundred bytes when kvbox.ram is QEMU's first RAM block, and reading
// all 16 MiB of a state file is slow (docs/design.md#live-copy-of-ram).
func findRAMBlock(r io.ReaderAt, ramSize, fileSize int64) (mappedRAMHeader, error) {
	key := append([]byte{byte(len(ramBlockID))}, ramBlockID...)
	key = binary.BigEndian.AppendUint64(key, uint64(ramSize))
	for _, n := range []int{64 << 10, 1 << 20, 16 << 20} {
		b := make([]byte, n)
		m, err := r.ReadAt(b, 0)
		if err != nil && err != io.EOF {
			return mappedRAMHeader{}, err
		}
		if h, ok := scanRAMBlock(b[:m], key, fileSize); ok {
			return h, nil
		}
		if m < n {
			break // the whole stream was read
		}
	}
	return mappedRAMHeader{}, fmt.Errorf("no mapped-ram block %q of %d bytes in the migration stream", ramBlockID, ramSize)
}

// scanRAMBlock looks for key (a RAM block's id and length) followed by a
// plausible mapped-ram header in b.
func scanRAMBlock(b, key []byte, fileSize int64) (mappedRAMHeader, bool) {
	for off := 0; ; {
		i := bytes.Index(b[off:], key)
		if i < 0 {
			return mappedRAMHeader{}, false
		}
		p := off + i + len(key)
		off += i + 1
		if p+mappedRAMHeaderSize > len(b) {
			continue
		}
		var h mappedRAMHeader
		binary.Read(bytes.NewReader(b[p:p+mappedRAMHeaderSize]), binary.BigEndian, &h)
		if h.Version == 1 && h.PageSize >= 4096 && h.PageSize&(h.PageSize-1) == 0 &&
			h.BitmapOffset < h.PagesOffset && h.PagesOffset%h.PageSize == 0 &&
			int64(h.PagesOffset) <= fileSize {
			return h, true
		}
	}
}
