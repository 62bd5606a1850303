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
	var h QCOW2Header
	var b [104]byte
	n, err := r.ReadAt(b[:], 0)
	if n < 72 {
		if err == nil || errors.Is(err, io.EOF) {
			err = errors.New("too short for a qcow2 header")
		}
		return h, err
	}
	be := binary.BigEndian
	if string(b[:4]) != "QFI\xfb" {
		return h, errors.New("not a qcow2 image (bad magic)")
	}
	h.Version = be.Uint32(b[4:])
	backingOff, backingLen := be.Uint64(b[8:]), be.Uint32(b[16:])
	h.ClusterBits = be.Uint32(b[20:])
	h.VirtualSize = be.Uint64(b[24:])
	h.CryptMethod = be.Uint32(b[32:])
	h.Snapshots = be.Uint32(b[60:])
	if h.Version != 2 && h.Version != 3 {
		return h, fmt.Errorf("qcow2 version %d (2 or 3)", h.Version)
	}
	if h.ClusterBits < 9 || h.ClusterBits > 21 {
		return h, fmt.Errorf("qcow2 cluster bits %d (9 to 21)", h.ClusterBits)
	}
	cluster := uint64(1) << h.ClusterBits
	headerLen := uint64(72)
	if h.Version == 3 {
		if n < 104 {
			return h, errors.New("too short for a qcow2 version 3 header")
		}
		h.IncompatibleFeatures = be.Uint64(b[72:])
		h.AutoclearFeatures = be.Uint64(b[88:])
		headerLen = uint64(be.Uint32(b[100:]))
		if headerLen < 104 || headerLen > cluster {
			return h, fmt.Errorf("qcow2 header length %d", headerLen)
		}
		// The header's length is rounded up to 8 bytes before extensions.
		headerLen = (headerLen + 7) &^ 7
	}
	h.HasDataFile = h.IncompatibleFeatures&QCOW2IncompatDataFile != 0
	// Extensions end where the backing file name begins, or at the end
	// of the first cluster.
	end := cluster
	if backingOff != 0 {
		if backingLen == 0 || backingLen > qcow2MaxBackingName || backingOff < headerLen || backingOff+uint64(backingLen) > cluster {
			return h, fmt.Errorf("qcow2 backing file name of %d bytes at %d, outside the first cluster", backingLen, backingOff)
		}
		name := make([]byte, backingLen)
		if _, err := r.ReadAt(name, int64(backingOff)); err != nil {
			return h, fmt.Errorf("qcow2 backing file name: %w", err)
		}
		h.BackingFile = string(name)
		end = backingOff
	}
	off := headerLen
	for i := 0; ; i++ {
		if i == qcow2MaxExts {
			return h, errors.New("qcow2 header has too many extensions")
		}
		if off+8 > end {
			if h.Version == 2 {
				break // a version 2 image may have no end marker
			}
			return h, errors.New("qcow2 header extensions run past the first cluster")
		}
		var e [8]byte
		if _, err := r.ReadAt(e[:], int64(off)); err != nil {
			if h.Version == 2 && errors.Is(err, io.EOF) {
				break
			}
			return h, fmt.Errorf("qcow2 header extension: %w", err)
		}
		typ, l := be.Uint32(e[:]), uint64(be.Uint32(e[4:]))
		if typ == qcow2ExtEnd {
			break
		}
		off += 8
		if off+l > end {
			return h, fmt.Errorf("qcow2 header extension %#x of %d bytes runs past the first cluster", typ, l)
		}
		switch typ {
		case qcow2ExtBackingFormat, qcow2ExtDataFile:
			v := make([]byte, l)
			if _, err := r.ReadAt(v, int64(off)); err != nil {
				return h, fmt.Errorf("qcow2 header extension %#x: %w", typ, err)
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
	return h, nil
}
