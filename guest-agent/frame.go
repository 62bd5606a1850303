package agent

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
)

// Wire format of one frame (all integers big-endian):
//
//	0  magic "KVB\x01"
//	4  type   u8
//	5  flags  u8 (zero)
//	6  rsvd   u16 (zero)
//	8  id     u32  call id; stream frames carry the id of their exec call
//	12 length u32  payload length, at most MaxPayload
//	16 pcrc   u32  CRC-32C of the payload
//	20 hcrc   u32  CRC-32C of bytes 0..19
//	24 payload
//
// The header CRC lets the decoder reject a stale or garbage header before
// it waits for a payload that may never come.
const (
	headerLen = 24
	// MaxPayload bounds one frame's payload. It also bounds how much a
	// decoder must buffer while resynchronising.
	MaxPayload = 64 << 10
	// chunkSize is the largest stream chunk either side sends: a frame
	// (header included) of exactly 32 KiB, because the guest's
	// virtio_console sends at most 32 KiB per write as one buffer, and a
	// frame one byte larger costs a second buffer, write and interrupt.
	chunkSize = 32<<10 - headerLen
)

var magic = [4]byte{'K', 'V', 'B', 1}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

type frameType uint8

const (
	frameHello    frameType = iota + 1 // both ways: 16-byte nonce (+ JSON from the guest)
	frameRequest                       // host→guest: JSON request
	frameResponse                      // guest→host: JSON response
	frameStdin                         // host→guest: stdin bytes
	frameStdinEOF                      // host→guest: stdin closed
	frameStdinAck                      // guest→host: one stdin frame consumed
	frameStdout                        // guest→host: stdout (or pty) bytes
	frameStderr                        // guest→host: stderr bytes
	frameResize                        // host→guest: JSON WinSize
	frameExit                          // guest→host: JSON exit status; last frame of an exec
	frameSignal                        // host→guest: JSON signal to the exec's process group
	frameData                          // both ways: bytes of a TCP stream (stream.go)
	frameDataAck                       // both ways: one data frame written out
	frameClose                         // both ways: the sender's end of a stream reached EOF
	frameReset                         // both ways: a stream is aborted
	frameTypeMax
)

func (t frameType) String() string {
	names := [...]string{"?", "hello", "request", "response", "stdin", "stdin-eof",
		"stdin-ack", "stdout", "stderr", "resize", "exit", "signal",
		"data", "data-ack", "close", "reset"}
	if int(t) < len(names) {
		return names[t]
	}
	return fmt.Sprintf("type%d", uint8(t))
}

// frame is one decoded frame. Payload is owned by the frame.
type frame struct {
	Type    frameType
	ID      uint32
	Payload []byte
}

// appendFrame encodes f onto b.
func appendFrame(b []byte, t frameType, id uint32, payload []byte) []byte {
	if len(payload) > MaxPayload {
		panic("agent: frame payload too large")
	}
	var h [headerLen]byte
	copy(h[0:4], magic[:])
	h[4] = byte(t)
	binary.BigEndian.PutUint32(h[8:], id)
	binary.BigEndian.PutUint32(h[12:], uint32(len(payload)))
	binary.BigEndian.PutUint32(h[16:], crc32.Checksum(payload, castagnoli))
	binary.BigEndian.PutUint32(h[20:], crc32.Checksum(h[:20], castagnoli))
	b = append(b, h[:]...)
	return append(b, payload...)
}

// parseHeader reports whether b (at least headerLen bytes) starts with a
// valid header, and the payload length it announces.
func parseHeader(b []byte) (t frameType, id uint32, n int, ok bool) {
	if [4]byte(b[0:4]) != magic || b[5] != 0 || b[6] != 0 || b[7] != 0 {
		return 0, 0, 0, false
	}
	if crc32.Checksum(b[:20], castagnoli) != binary.BigEndian.Uint32(b[20:]) {
		return 0, 0, 0, false
	}
	t = frameType(b[4])
	n64 := binary.BigEndian.Uint32(b[12:])
	if t == 0 || t >= frameTypeMax || n64 > MaxPayload {
		return 0, 0, 0, false
	}
	return t, binary.BigEndian.Uint32(b[8:]), int(n64), true
}

// errHostGone is returned by a reader when the peer went away but the
// stream goes on (a virtio-serial port whose host disconnected). The
// decoder drops any partial frame and the next Read waits for a new host.
var errHostGone = errors.New("agent: host disconnected")

// decoder reads frames from a byte stream that may contain garbage: stale
// bytes of an earlier connection, or a frame cut short. It skips bytes until
// a valid header, and a header whose payload fails its CRC is skipped by one
// byte so that a real frame hidden behind it is still found.
type decoder struct {
	r   io.Reader
	buf []byte // buf[off:end] is unread
	off int
	end int
	// Skipped counts garbage bytes dropped while resynchronising.
	skipped int64
	// consumed counts every byte the decoder moved past; badCRC the payload
	// bytes it checksummed in vain. Together they bound the CPU a peer can
	// make it burn (see next).
	consumed int64
	badCRC   int64
}

// badCRCBudget bounds the payload bytes checksummed in vain to this many per
// byte consumed (plus one frame): past it, a frame whose payload fails its
// CRC is skipped whole instead of by one byte.
const badCRCBudget = 4

func newDecoder(r io.Reader) *decoder {
	return &decoder{r: r, buf: make([]byte, 2*(headerLen+MaxPayload))}
}

// reset drops everything buffered (the peer changed).
func (d *decoder) reset() { d.off, d.end = 0, 0 }

// fill reads until at least n bytes are buffered.
func (d *decoder) fill(n int) error {
	for d.end-d.off < n {
		if d.off > 0 && len(d.buf)-d.off < n {
			d.end = copy(d.buf, d.buf[d.off:d.end])
			d.off = 0
		}
		if d.end == len(d.buf) {
			d.end = copy(d.buf, d.buf[d.off:d.end])
			d.off = 0
		}
		m, err := d.r.Read(d.buf[d.end:])
		d.end += m
		if err != nil {
			if d.end-d.off >= n {
				return nil
			}
			if errors.Is(err, io.EOF) && d.end-d.off > 0 {
				return io.ErrUnexpectedEOF
			}
			return err
		}
	}
	return nil
}

func (d *decoder) skip(n int) {
	d.off += n
	d.skipped += int64(n)
	d.consumed += int64(n)
}

// next returns the next valid frame.
func (d *decoder) next() (frame, error) {
	for {
		if err := d.fill(headerLen); err != nil {
			return frame{}, err
		}
		b := d.buf[d.off:d.end]
		i := indexMagic(b)
		if i < 0 {
			// Keep a tail that may be the start of a magic.
			keep := min(len(b), len(magic)-1)
			d.skip(len(b) - keep)
			if err := d.fill(keep + 1); err != nil {
				return frame{}, err
			}
			continue
		}
		if i > 0 {
			d.skip(i)
			continue
		}
		t, id, n, ok := parseHeader(b)
		if !ok {
			d.skip(1)
			continue
		}
		if err := d.fill(headerLen + n); err != nil {
			return frame{}, err
		}
		b = d.buf[d.off : d.off+headerLen+n]
		p := b[headerLen:]
		if crc32.Checksum(p, castagnoli) != binary.BigEndian.Uint32(b[16:]) {
			// Skipping one byte finds a real frame hidden behind a cut one,
			// but a peer can pack 64 KiB-claiming headers every 24 bytes and
			// make each byte cost a 64 KiB CRC. Past the budget the decoder
			// skips the whole claimed frame: its work stays linear.
			d.badCRC += int64(n)
			if d.badCRC > badCRCBudget*d.consumed+MaxPayload {
				d.skip(headerLen + n)
			} else {
				d.skip(1)
			}
			continue
		}
		f := frame{Type: t, ID: id, Payload: append([]byte(nil), p...)}
		d.off += headerLen + n
		d.consumed += int64(headerLen + n)
		return f, nil
	}
}

// indexMagic returns the index of the first full magic in b, or of a magic
// prefix at its end, or -1.
func indexMagic(b []byte) int {
	for i := 0; i < len(b); i++ {
		if b[i] != magic[0] {
			continue
		}
		m := min(len(magic), len(b)-i)
		if [4]byte(append(b[i:i+m:i+m], magic[m:]...)) == magic {
			if m < len(magic) {
				return -1 // a possible magic split at the end: keep the tail
			}
			return i
		}
	}
	return -1
}
