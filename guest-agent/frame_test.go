package agent

import (
	"bytes"
	"errors"
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
