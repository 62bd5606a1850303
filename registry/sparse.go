package registry

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/klauspost/compress/zstd"

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

// decodeSparse writes the file encoded in r to path (created, holes kept).
func decodeSparse(r io.Reader, path string) error {
	zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1))
	if err != nil {
		return err
	}
	defer zr.Close()
	br := bufio.NewReaderSize(zr, 1<<20)
	var hdr [24]byte
	if _, err := io.ReadFull(br, hdr[:]); err != nil {
		return fmt.Errorf("not a kvbox part: %w", err)
	}
	if [8]byte(hdr[:8]) != sparseMagic {
		return errors.New("not a kvbox part (bad magic)")
	}
	size := int64(binary.BigEndian.Uint64(hdr[8:]))
	n := binary.BigEndian.Uint64(hdr[16:])
	if size < 0 || n > maxExtents {
		return fmt.Errorf("kvbox part: bad header (size %d, %d extents)", size, n)
	}
	ex := make([]extent, n)
	var prev int64
	for i := range ex {
		var b [16]byte
		if _, err := io.ReadFull(br, b[:]); err != nil {
			return fmt.Errorf("kvbox part: extent map: %w", err)
		}
		e := extent{Off: int64(binary.BigEndian.Uint64(b[:8])), Len: int64(binary.BigEndian.Uint64(b[8:]))}
		if e.Off < prev || e.Len < 0 || e.Off+e.Len > size || e.Off+e.Len < e.Off {
			return fmt.Errorf("kvbox part: extent %d out of order or out of range", i)
		}
		prev = e.Off + e.Len
		ex[i] = e
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return err
	}
	for _, e := range ex {
		if _, err := io.CopyN(io.NewOffsetWriter(f, e.Off), br, e.Len); err != nil {
			return fmt.Errorf("kvbox part: extent at %d: %w", e.Off, err)
		}
	}
	if extra, _ := br.Read(make([]byte, 1)); extra != 0 {
		return errors.New("kvbox part: trailing data")
	}
	return f.Sync()
}
