package snapshot

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"os"

	"kvbox.dev/kvbox/domain"
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

// prepareMappedRAM readies a state file written with mapped-ram for clones
// to map: it finds kvbox.ram's block, zeroes its page bitmap so that loading
// the state reads no page (the clone maps the pages from the file instead,
// privately, at the returned offset), and returns that offset.
func prepareMappedRAM(path string, ramSize int64) (int64, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	h, err := findRAMBlock(io.NewSectionReader(f, 0, min(fi.Size(), 16<<20)), ramSize, fi.Size())
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	pages := (uint64(ramSize) + h.PageSize - 1) / h.PageSize
	bitmapBytes := (pages + 63) / 64 * 8 // BITS_TO_LONGS(pages) * sizeof(long)
	if h.BitmapOffset+bitmapBytes > h.PagesOffset {
		return 0, fmt.Errorf("%s: mapped-ram bitmap overlaps the pages", path)
	}
	if _, err := f.WriteAt(make([]byte, bitmapBytes), int64(h.BitmapOffset)); err != nil {
		return 0, err
	}
	return int64(h.PagesOffset), f.Sync()
}

// findRAMBlock locates kvbox.ram's mapped-ram header in the head of a
// migration stream: the id (length-prefixed), its used length, the header.
func findRAMBlock(r io.ReaderAt, ramSize, fileSize int64) (mappedRAMHeader, error) {
	var head bytes.Buffer
	if _, err := io.Copy(&head, io.NewSectionReader(r, 0, 16<<20)); err != nil {
		return mappedRAMHeader{}, err
	}
	b := head.Bytes()
	key := append([]byte{byte(len(ramBlockID))}, ramBlockID...)
	key = binary.BigEndian.AppendUint64(key, uint64(ramSize))
	for off := 0; ; {
		i := bytes.Index(b[off:], key)
		if i < 0 {
			return mappedRAMHeader{}, fmt.Errorf("no mapped-ram block %q of %d bytes in the migration stream", ramBlockID, ramSize)
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
			return h, nil
		}
	}
}
