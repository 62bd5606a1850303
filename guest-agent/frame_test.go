package agent

import (
	"bytes"
	"errors"
	"hash/crc32"
	"io"
	"testing"
	"testing/iotest"
)

func TestDecoderResync(t *testing.T) {
	var stream []byte
	stream = append(stream, "garbage"...)
	stream = append(stream, magic[:3]...)
	stream = appendFrame(stream, frameStdout, 1, []byte("one"))
	bad := appendFrame(nil, frameStdout, 2, []byte("corrupt"))
	bad[len(bad)-1] ^= 0xff // payload CRC fails
	stream = append(stream, bad...)
	stream = append(stream, magic[:]...) // a bare magic
	stream = appendFrame(stream, frameExit, 3, nil)
	stream = appendFrame(stream, frameStdout, 4, bytes.Repeat([]byte{'z'}, MaxPayload))

	for name, r := range map[string]io.Reader{
		"whole":    bytes.NewReader(stream),
		"one byte": iotest.OneByteReader(bytes.NewReader(stream)),
	} {
		t.Run(name, func(t *testing.T) {
			d := newDecoder(r)
			var ids []uint32
			for {
				f, err := d.next()
				if err != nil {
					if !errors.Is(err, io.EOF) {
						t.Fatal(err)
					}
					break
				}
				ids = append(ids, f.ID)
			}
			if len(ids) != 3 || ids[0] != 1 || ids[1] != 3 || ids[2] != 4 {
				t.Errorf("ids = %v, want [1 3 4]", ids)
			}
		})
	}
}

func TestDecoderCutShort(t *testing.T) {
	f := appendFrame(nil, frameStdout, 1, []byte("hello"))
	d := newDecoder(bytes.NewReader(f[:len(f)-2]))
	if _, err := d.next(); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("err = %v", err)
	}
}

// FuzzDecoder: whatever bytes a guest (or a stale stream) sends, the
// decoder neither panics nor returns a frame that does not re-encode to
// the same bytes, and a valid frame after the junk is still found.
func FuzzDecoder(f *testing.F) {
	f.Add([]byte{})
	f.Add(appendFrame(nil, frameHello, 1, make([]byte, 16)))
	f.Add(appendFrame(nil, frameStdout, 7, []byte("x"))[:10])
	f.Add(append(magic[:], 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff))
	f.Fuzz(func(t *testing.T, junk []byte) {
		tail := appendFrame(nil, frameExit, 0xdeadbeef, []byte(`{"code":0}`))
		// Padding as the host's HELLO retry sends it completes any frame
		// the junk started.
		stream := append(append(append([]byte(nil), junk...), make([]byte, headerLen+MaxPayload)...), tail...)
		d := newDecoder(bytes.NewReader(stream))
		found := false
		for {
			fr, err := d.next()
			if err != nil {
				break
			}
			if len(fr.Payload) > MaxPayload {
				t.Fatalf("payload of %d bytes", len(fr.Payload))
			}
			enc := appendFrame(nil, fr.Type, fr.ID, fr.Payload)
			if !bytes.Contains(stream, enc) {
				t.Fatalf("decoded a frame that is not in the input")
			}
			if fr.ID == 0xdeadbeef && fr.Type == frameExit {
				found = true
			}
		}
		if !found {
			t.Fatalf("lost the valid frame after %d junk bytes", len(junk))
		}
	})
}

// A guest packing a header that claims a full payload with a wrong CRC every
// 24 bytes used to make the host checksum 64 KiB per byte it sent (measured
// 9.2 MB/s of such bytes pinned a host core). The decoder's vain CRC work
// must stay linear in its input, and a real frame after the flood is found.
func TestDecoderCRCFloodIsLinear(t *testing.T) {
	h := appendFrame(nil, frameStdout, 7, make([]byte, MaxPayload))[:headerLen]
	h[16] ^= 0xff // payload CRC wrong; recompute the header CRC so the header is valid
	hc := crc32Castagnoli(h[:20])
	h[20], h[21], h[22], h[23] = byte(hc>>24), byte(hc>>16), byte(hc>>8), byte(hc)
	if _, _, _, ok := parseHeader(h); !ok {
		t.Fatal("crafted header does not parse")
	}
	var stream []byte
	for len(stream) < 1<<20 {
		stream = append(stream, h...)
	}
	stream = append(stream, make([]byte, headerLen+MaxPayload)...)
	stream = appendFrame(stream, frameExit, 9, []byte("real"))

	d := newDecoder(bytes.NewReader(stream))
	f, err := d.next()
	if err != nil {
		t.Fatal(err)
	}
	if f.ID != 9 || string(f.Payload) != "real" {
		t.Fatalf("got frame %d %q, want the real frame 9", f.ID, f.Payload)
	}
	limit := 5*int64(len(stream)) + 2*MaxPayload // linear, whatever badCRCBudget is
	t.Logf("input %d bytes, checksummed in vain %d bytes (limit %d; unbounded it would be %d)",
		len(stream), d.badCRC, limit, int64(len(stream)/headerLen)*MaxPayload)
	if d.badCRC > limit {
		t.Fatalf("decoder checksummed %d bytes in vain for %d bytes of input", d.badCRC, len(stream))
	}
}

func crc32Castagnoli(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }
