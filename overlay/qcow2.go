package overlay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// QCOW2Header is what a qcow2 image's header says about where its data
// lives, read from the header alone (docs/interop/qcow2.txt of QEMU):
// nothing it names is opened. qemu-img info, by contrast, opens an
// external data file to report on it, and a file handed to kvbox by
// someone else may name any host path there.
type QCOW2Header struct {
	Version     uint32
	ClusterBits uint32
	VirtualSize uint64
	CryptMethod uint32
	Snapshots   uint32 // internal snapshots
	// IncompatibleFeatures, AutoclearFeatures: version 3 feature bits
	// (0 for version 2).
	IncompatibleFeatures, AutoclearFeatures uint64
	BackingFile                             string // "" for none
	BackingFormat                           string // the backing format extension, "" for none
	DataFile                                string // the external data file extension, "" for none
	HasDataFile                             bool   // the incompatible feature bit for an external data file is set
	Encrypted                               bool   // a full disk encryption header extension is present
}

// qcow2 feature bits and header extensions kvbox reads.
const (
	QCOW2IncompatDirty       = 1 << 0
	QCOW2IncompatCorrupt     = 1 << 1
	QCOW2IncompatDataFile    = 1 << 2
	QCOW2IncompatCompression = 1 << 3
	QCOW2IncompatExtendedL2  = 1 << 4
	QCOW2AutoclearBitmaps    = 1 << 0
	QCOW2AutoclearRawData    = 1 << 1

	qcow2ExtEnd           = 0x00000000
	qcow2ExtBackingFormat = 0xe2792aca
	qcow2ExtDataFile      = 0x44415441
	qcow2ExtEncryption    = 0x0537be77
	qcow2MaxExts          = 256
	qcow2MaxBackingName   = 1023 // QEMU's own limit
)

// ReadQCOW2Header reads and checks the structure of r's qcow2 header and
// header extensions; every read is bounded by the header's own fields and
// by the first cluster, where QEMU keeps them.
func ReadQCOW2Header(r io.ReaderAt) (QCOW2Header, error) {
	h, l, err := readQCOW2Fixed(r)
	if err != nil {
		return h, err
	}
	// Extensions end where the backing file name begins, or at the end
	// of the first cluster.
	end := l.cluster
	if l.backingOff != 0 {
		if err := readQCOW2Backing(r, &h, l); err != nil {
			return h, err
		}
		end = l.backingOff
	}
	return h, readQCOW2Extensions(r, &h, l.headerLen, end)
}

// qcow2Layout is where the parts of a qcow2 header's first cluster are,
// as its fixed fields say.
type qcow2Layout struct {
	cluster    uint64 // the cluster size
	headerLen  uint64 // where the extensions begin
	backingOff uint64 // where the backing file name is (0: none)
	backingLen uint32
}

// readQCOW2Fixed reads and checks the header's fixed fields: the magic,
// the version, the cluster size and, in version 3, the header's length.
func readQCOW2Fixed(r io.ReaderAt) (QCOW2Header, qcow2Layout, error) {
	var h QCOW2Header
	var l qcow2Layout
	var b [104]byte
	n, err := r.ReadAt(b[:], 0)
	if n < 72 {
		if err == nil || errors.Is(err, io.EOF) {
			err = errors.New("too short for a qcow2 header")
		}
		return h, l, err
	}
	be := binary.BigEndian
	if string(b[:4]) != "QFI\xfb" {
		return h, l, errors.New("not a qcow2 image (bad magic)")
	}
	h.Version = be.Uint32(b[4:])
	l.backingOff, l.backingLen = be.Uint64(b[8:]), be.Uint32(b[16:])
	h.ClusterBits = be.Uint32(b[20:])
	h.VirtualSize = be.Uint64(b[24:])
	h.CryptMethod = be.Uint32(b[32:])
	h.Snapshots = be.Uint32(b[60:])
	if h.Version != 2 && h.Version != 3 {
		return h, l, fmt.Errorf("qcow2 version %d (2 or 3)", h.Version)
	}
	if h.ClusterBits < 9 || h.ClusterBits > 21 {
		return h, l, fmt.Errorf("qcow2 cluster bits %d (9 to 21)", h.ClusterBits)
	}
	l.cluster = uint64(1) << h.ClusterBits
	l.headerLen = uint64(72)
	if h.Version == 3 {
		if n < 104 {
			return h, l, errors.New("too short for a qcow2 version 3 header")
		}
		h.IncompatibleFeatures = be.Uint64(b[72:])
		h.AutoclearFeatures = be.Uint64(b[88:])
		l.headerLen = uint64(be.Uint32(b[100:]))
		if l.headerLen < 104 || l.headerLen > l.cluster {
			return h, l, fmt.Errorf("qcow2 header length %d", l.headerLen)
		}
		// The header's length is rounded up to 8 bytes before extensions.
		l.headerLen = (l.headerLen + 7) &^ 7
	}
	h.HasDataFile = h.IncompatibleFeatures&QCOW2IncompatDataFile != 0
	return h, l, nil
}

// readQCOW2Backing reads the backing file name, which must lie after the
// header and within the first cluster.
func readQCOW2Backing(r io.ReaderAt, h *QCOW2Header, l qcow2Layout) error {
	if l.backingLen == 0 || l.backingLen > qcow2MaxBackingName || l.backingOff < l.headerLen || l.backingOff+uint64(l.backingLen) > l.cluster {
		return fmt.Errorf("qcow2 backing file name of %d bytes at %d, outside the first cluster", l.backingLen, l.backingOff)
	}
	name := make([]byte, l.backingLen)
	if _, err := r.ReadAt(name, int64(l.backingOff)); err != nil {
		return fmt.Errorf("qcow2 backing file name: %w", err)
	}
	h.BackingFile = string(name)
	return nil
}

// readQCOW2Extensions reads the header extensions from off to end: the
// backing format, the data file and whether it is encrypted, at most
// qcow2MaxExts of them, each within end.
func readQCOW2Extensions(r io.ReaderAt, h *QCOW2Header, off, end uint64) error {
	be := binary.BigEndian
	for i := 0; ; i++ {
		if i == qcow2MaxExts {
			return errors.New("qcow2 header has too many extensions")
		}
		if off+8 > end {
			if h.Version == 2 {
				break // a version 2 image may have no end marker
			}
			return errors.New("qcow2 header extensions run past the first cluster")
		}
		var e [8]byte
		if _, err := r.ReadAt(e[:], int64(off)); err != nil {
			if h.Version == 2 && errors.Is(err, io.EOF) {
				break
			}
			return fmt.Errorf("qcow2 header extension: %w", err)
		}
		typ, l := be.Uint32(e[:]), uint64(be.Uint32(e[4:]))
		if typ == qcow2ExtEnd {
			break
		}
		off += 8
		if off+l > end {
			return fmt.Errorf("qcow2 header extension %#x of %d bytes runs past the first cluster", typ, l)
		}
		switch typ {
		case qcow2ExtBackingFormat, qcow2ExtDataFile:
			v := make([]byte, l)
			if _, err := r.ReadAt(v, int64(off)); err != nil {
				return fmt.Errorf("qcow2 header extension %#x: %w", typ, err)
			}
			if typ == qcow2ExtBackingFormat {
				h.BackingFormat = string(v)
			} else {
				h.DataFile = string(v)
			}
		case qcow2ExtEncryption:
			h.Encrypted = true
		}
		off += (l + 7) &^ 7
	}
	return nil
}
