package vmstate

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
)

// fakeStream builds the head of a mapped-ram migration stream as QEMU
// writes it: another block first, then kvbox.ram with its header.
func fakeStream(ramSize int64, bitmapOff, pagesOff uint64) []byte {
	var b bytes.Buffer
	b.WriteString("QEVM\x00\x00\x00\x03junk")
	for _, blk := range []struct {
		id   string
		size int64
	}{{"pc.bios", 256 << 10}, {ramBlockID, ramSize}} {
		b.WriteByte(byte(len(blk.id)))
		b.WriteString(blk.id)
		binary.Write(&b, binary.BigEndian, uint64(blk.size))
		binary.Write(&b, binary.BigEndian, mappedRAMHeader{1, 4096, bitmapOff, pagesOff})
	}
	return b.Bytes()
}

func TestPrepareMappedRAM(t *testing.T) {
	const ram = 64 << 20
	const bitmapOff, pagesOff = 4096, 1 << 20
	file := make([]byte, pagesOff+ram)
	copy(file, fakeStream(ram, bitmapOff, pagesOff))
	for i := bitmapOff; i < bitmapOff+ram/4096/8; i++ {
		file[i] = 0xff
	}
	file[pagesOff] = 0xab
	path := filepath.Join(t.TempDir(), "state")
	if err := os.WriteFile(path, file, 0o644); err != nil {
		t.Fatal(err)
	}
	off, err := PrepareMapped(path, ram)
	if err != nil || off != pagesOff {
		t.Fatalf("PrepareMapped = %d, %v; want %d", off, err, pagesOff)
	}
	got, _ := os.ReadFile(path)
	for i := bitmapOff; i < bitmapOff+ram/4096/8; i++ {
		if got[i] != 0 {
			t.Fatalf("bitmap byte %d not cleared", i)
		}
	}
	if got[pagesOff] != 0xab {
		t.Fatal("a page was touched")
	}
	// Again (a resume killed after readying the file): the bitmap is all
	// zero now, and no page may be punched for it.
	if off, err := PrepareMapped(path, ram); err != nil || off != pagesOff {
		t.Fatalf("PrepareMapped again = %d, %v; want %d", off, err, pagesOff)
	}
	if got, _ := os.ReadFile(path); got[pagesOff] != 0xab {
		t.Fatal("readying the file again zeroed a page")
	}
}

// The header is found past the first window findRAMBlock reads.
func TestFindRAMBlockPastFirstWindow(t *testing.T) {
	const ram = 64 << 20
	stream := append(make([]byte, 200<<10), fakeStream(ram, 4096, 1<<20)...)
	h, err := findRAMBlock(bytes.NewReader(stream), ram, ram+2<<20)
	if err != nil || h.PagesOffset != 1<<20 {
		t.Fatalf("findRAMBlock = %+v, %v", h, err)
	}
}

func TestPrepareMappedRAMRejectsOtherStreams(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state")
	os.WriteFile(path, fakeStream(32<<20, 4096, 1<<20), 0o644) // another RAM size
	if _, err := PrepareMapped(path, 64<<20); err == nil {
		t.Fatal("found a block of the wrong size")
	}
	os.WriteFile(path, fakeStream(64<<20, 1<<20, 4096), 0o644) // offsets the wrong way round
	if _, err := PrepareMapped(path, 64<<20); err == nil {
		t.Fatal("accepted a header with the bitmap after the pages")
	}
}

func FuzzFindRAMBlock(f *testing.F) {
	f.Add(fakeStream(64<<20, 4096, 1<<20))
	f.Fuzz(func(t *testing.T, b []byte) {
		findRAMBlock(bytes.NewReader(b), 64<<20, int64(len(b))+64<<20)
	})
}

// A page whose bit is clear reads as zeros after PrepareMapped, whatever
// a live copy's earlier pass left in the file; a page whose bit is set
// keeps its bytes.
func TestPrepareMappedRAMZeroesUnsentPages(t *testing.T) {
	const ram = 1 << 20 // 256 pages
	const bitmapOff, pagesOff = 4096, 64 << 10
	file := make([]byte, pagesOff+ram)
	copy(file, fakeStream(ram, bitmapOff, pagesOff))
	for p := 0; p < ram/4096; p++ {
		file[pagesOff+p*4096] = byte(p + 1) // every page has stale or live bytes
	}
	file[bitmapOff] = 0b00000101 // pages 0 and 2 sent
	file[bitmapOff+31] = 0x80    // page 255 sent
	path := filepath.Join(t.TempDir(), "state")
	if err := os.WriteFile(path, file, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := PrepareMapped(path, ram); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(path)
	if len(got) != len(file) {
		t.Fatalf("file size %d, want %d", len(got), len(file))
	}
	for p := 0; p < ram/4096; p++ {
		want := byte(0)
		if p == 0 || p == 2 || p == 255 {
			want = byte(p + 1)
		}
		if b := got[pagesOff+p*4096]; b != want {
			t.Errorf("page %d reads %d, want %d", p, b, want)
		}
	}
	if !bytes.Equal(got[:bitmapOff], file[:bitmapOff]) {
		t.Error("the stream head changed")
	}
}

// TestHintGate: the held copy runs once the hints have stopped coming for
// hintSettle, once none came by hintFirst, or at hintMax; the held copy's
// own pages are not hints.
