package registry

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/klauspost/compress/zstd"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/overlay"
)

// A part of a snapshot travels as one zstd frame stream holding an extent
// map and then only the data of those extents:
//
//	"KVBXSPR1"  magic
//	u64         apparent size of the file
//	u64         number of extents
//	n × (u64 offset, u64 length)
//	the bytes of every extent, in order
//
// Holes (found with SEEK_DATA/SEEK_HOLE) are neither read nor sent, so a
// 4 GiB RAM file with 1.4 GB touched costs 1.4 GB before compression.
// The encoder runs single-threaded at a fixed level, so the same file
// gives the same bytes and so the same digest: a second push of an
// unchanged part finds the blob in the registry and sends nothing.

var sparseMagic = [8]byte{'K', 'V', 'B', 'X', 'S', 'P', 'R', '1'}

// MaxExtents bounds what a decoder accepts from a blob.
const maxExtents = 1 << 24

type extent = overlay.Extent

// extents returns the data extents of f (the whole file where the
// filesystem does not report holes).
func extents(f *os.File) ([]extent, int64, error) { return overlay.DataExtents(f) }

func newEncoder(w io.Writer) (*zstd.Encoder, error) {
	return zstd.NewWriter(w, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(1),
		zstd.WithZeroFrames(true))
}

// encodeSparse writes path's extent map and data, zstd-compressed, to w.
// It returns the apparent size and the data bytes.
func encodeSparse(path string, w io.Writer) (size, data int64, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	ex, size, err := extents(f)
	if err != nil {
		return 0, 0, fmt.Errorf("%s: extents: %w", path, err)
	}
	zw, err := newEncoder(w)
	if err != nil {
		return 0, 0, err
	}
	hdr := make([]byte, 0, 24+16*len(ex))
	hdr = append(hdr, sparseMagic[:]...)
	hdr = binary.BigEndian.AppendUint64(hdr, uint64(size))
	hdr = binary.BigEndian.AppendUint64(hdr, uint64(len(ex)))
	for _, e := range ex {
		hdr = binary.BigEndian.AppendUint64(hdr, uint64(e.Off))
		hdr = binary.BigEndian.AppendUint64(hdr, uint64(e.Len))
	}
	if _, err := zw.Write(hdr); err != nil {
		return 0, 0, err
	}
	for _, e := range ex {
		n, err := io.Copy(zw, io.NewSectionReader(f, e.Off, e.Len))
		if err != nil {
			return 0, 0, fmt.Errorf("%s: %w", path, err)
		}
		if n != e.Len {
			return 0, 0, fmt.Errorf("%s changed while being read (short extent at %d)", path, e.Off)
		}
		data += n
	}
	return size, data, zw.Close()
}

// maxWindow bounds the memory a part's zstd stream may ask the decoder
// for: kvbox's encoder (SpeedFastest) uses a 4 MiB window, the zstd
// decoder's default allows 512 MiB.
const maxWindow = 32 << 20

// newDecoder reads a part's zstd stream; small: for a small part, with
// buffers sized to it.
func newDecoder(r io.Reader, small bool) (*zstd.Decoder, error) {
	return zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(maxWindow), zstd.WithDecoderLowmem(small))
}

// readPartHeader reads a part's extent map and checks it against the
// sizes the manifest declared for it (apparent, data): the file it encodes
// is exactly that large, with exactly that much data, before a byte of it
// is written.
func readPartHeader(br io.Reader, apparent, data int64) ([]extent, error) {
	var hdr [24]byte
	if _, err := io.ReadFull(br, hdr[:]); err != nil {
		return nil, fmt.Errorf("not a kvbox part: %w", err)
	}
	if [8]byte(hdr[:8]) != sparseMagic {
		return nil, errors.New("not a kvbox part (bad magic)")
	}
	size := int64(binary.BigEndian.Uint64(hdr[8:]))
	n := binary.BigEndian.Uint64(hdr[16:])
	if size != apparent {
		return nil, base.Errorf(base.Invalid, "the part is a file of %d bytes, its manifest says %d", uint64(size), apparent)
	}
	// An extent holds at least 512 bytes of data after a hole of at least
	// as much: a map longer than that is no file's.
	if n > maxExtents || n > uint64(size/512+1) {
		return nil, base.Errorf(base.Invalid, "kvbox part: bad header (size %d, %d extents)", size, n)
	}
	ex := make([]extent, n)
	var prev, total int64
	for i := range ex {
		var b [16]byte
		if _, err := io.ReadFull(br, b[:]); err != nil {
			return nil, fmt.Errorf("kvbox part: extent map: %w", err)
		}
		e := extent{Off: int64(binary.BigEndian.Uint64(b[:8])), Len: int64(binary.BigEndian.Uint64(b[8:]))}
		if e.Off < prev || e.Len < 0 || e.Off+e.Len > size || e.Off+e.Len < e.Off {
			return nil, base.Errorf(base.Invalid, "kvbox part: extent %d out of order or out of range", i)
		}
		prev = e.Off + e.Len
		total += e.Len
		ex[i] = e
	}
	if total != data {
		return nil, base.Errorf(base.Invalid, "the part holds %d bytes of data, its manifest says %d", total, data)
	}
	return ex, nil
}

// decodeSparse writes the file encoded in r to path (created, holes kept)
// if it is the file the manifest declared: apparent bytes large, data
// bytes of it outside holes. Runs of zeroes are left as holes too.
func decodeSparse(r io.Reader, path string, apparent, data int64) error {
	zr, err := newDecoder(r, false)
	if err != nil {
		return err
	}
	defer zr.Close()
	br := bufio.NewReaderSize(zr, 1<<20)
	ex, err := readPartHeader(br, apparent, data)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(apparent); err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for _, e := range ex {
		for off, end := e.Off, e.Off+e.Len; off < end; {
			n := int(min(int64(len(buf)), end-off))
			if _, err := io.ReadFull(br, buf[:n]); err != nil {
				return fmt.Errorf("kvbox part: extent at %d: %w", e.Off, err)
			}
			if !allZero(buf[:n]) {
				if _, err := f.WriteAt(buf[:n], off); err != nil {
					return err
				}
			}
			off += int64(n)
		}
	}
	if extra, _ := br.Read(make([]byte, 1)); extra != 0 {
		return errors.New("kvbox part: trailing data")
	}
	return f.Sync()
}

// decodeSmall returns the file encoded in r, which the manifest declared
// to be apparent bytes, data of them outside holes (a small file: the
// caller bounds apparent).
func decodeSmall(r io.Reader, apparent, data int64) ([]byte, error) {
	zr, err := newDecoder(r, true)
	if err != nil {
		return nil, err
	}
	defer zr.Close()
	br := bufio.NewReader(zr)
	ex, err := readPartHeader(br, apparent, data)
	if err != nil {
		return nil, err
	}
	out := make([]byte, apparent)
	for _, e := range ex {
		if _, err := io.ReadFull(br, out[e.Off:e.Off+e.Len]); err != nil {
			return nil, fmt.Errorf("kvbox part: extent at %d: %w", e.Off, err)
		}
	}
	if extra, _ := br.Read(make([]byte, 1)); extra != 0 {
		return nil, errors.New("kvbox part: trailing data")
	}
	return out, nil
}

// allZero reports whether b holds only zero bytes.
func allZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
