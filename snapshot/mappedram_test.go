package snapshot

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"kvbox.dev/kvbox/qmp"
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
	off, err := prepareMappedRAM(path, ram)
	if err != nil || off != pagesOff {
		t.Fatalf("prepareMappedRAM = %d, %v; want %d", off, err, pagesOff)
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
	if off, err := prepareMappedRAM(path, ram); err != nil || off != pagesOff {
		t.Fatalf("prepareMappedRAM again = %d, %v; want %d", off, err, pagesOff)
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
	if _, err := prepareMappedRAM(path, 64<<20); err == nil {
		t.Fatal("found a block of the wrong size")
	}
	os.WriteFile(path, fakeStream(64<<20, 1<<20, 4096), 0o644) // offsets the wrong way round
	if _, err := prepareMappedRAM(path, 64<<20); err == nil {
		t.Fatal("accepted a header with the bitmap after the pages")
	}
}

func FuzzFindRAMBlock(f *testing.F) {
	f.Add(fakeStream(64<<20, 4096, 1<<20))
	f.Fuzz(func(t *testing.T, b []byte) {
		findRAMBlock(bytes.NewReader(b), 64<<20, int64(len(b))+64<<20)
	})
}

// A page whose bit is clear reads as zeros after prepareMappedRAM, whatever
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
	if _, err := prepareMappedRAM(path, ram); err != nil {
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
func TestHintGate(t *testing.T) {
	const total = 512 << 20
	ram := func(left int64) qmp.MigrateRAM {
		return qmp.MigrateRAM{Total: json.Number(strconv.Itoa(total)), Remaining: json.Number(strconv.FormatInt(left, 10))}
	}
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

	settle, first := int(hintSettle/time.Millisecond), int(hintFirst/time.Millisecond)
	g := &hintGate{start: t0}
	for _, p := range []struct {
		ms   int
		left int64
		hold bool
	}{
		{2, total - 4096, true},                                 // one page of its own: no hint
		{first - 10, total - 8192, true},                        // still none
		{first - 5, total - 100<<20, true},                      // 100 MB hinted
		{first + 10, total - 200<<20, true},                     // more
		{first + 10 + settle - 1, total - 200<<20 - 4096, true}, // its own page
		{first + 10 + settle, total - 200<<20 - 4096, false},
	} {
		if got := g.hold(at(p.ms), ram(p.left)); got != p.hold {
			t.Fatalf("at %d ms with %d left: hold %v, want %v", p.ms, p.left, got, p.hold)
		}
	}

	g = &hintGate{start: t0}
	if !g.hold(at(first-1), ram(total-8192)) || g.hold(at(first), ram(total-8192)) {
		t.Errorf("a guest that names nothing is waited for until hintFirst, and no longer")
	}

	g = &hintGate{start: t0}
	left := int64(total)
	for ms := 10; ms < 2000; ms += settle / 2 {
		left -= 2 << 20
		if !g.hold(at(ms), ram(left)) {
			t.Fatalf("a guest still naming pages was let go at %d ms", ms)
		}
	}
	if g.hold(at(2000), ram(left-2<<20)) {
		t.Errorf("held past hintMax")
	}
}

// TestPacer: a live copy is polled slowly while much is left at the fastest
// pace it went yet, and fast while held, when its pace is not known yet, at
// a new pass, near its end, and outside precopy.
func TestPacer(t *testing.T) {
	t0 := time.Unix(1000, 0)
	active := func(left int64) qmp.MigrateStatus {
		return qmp.MigrateStatus{Status: qmp.MigrationActive, RAM: &qmp.MigrateRAM{Remaining: json.Number(strconv.FormatInt(left, 10))}}
	}
	const mb = 1 << 20
	var p pacer
	for i, c := range []struct {
		ms   int
		s    qmp.MigrateStatus
		held bool
		want time.Duration
	}{
		{0, qmp.MigrateStatus{Status: qmp.MigrationSetup}, false, pollFast},
		{2, active(4096 * mb), true, pollFast},   // held at the gate
		{4, active(4096 * mb), false, pollFast},  // let go: no pace yet
		{6, active(4094 * mb), false, pollSlow},  // 1 MB/ms: 4 s left
		{26, active(4094 * mb), false, pollSlow}, // not moving
		{46, active(3094 * mb), false, pollSlow}, // 50 MB/ms: 62 ms left
		{66, active(3074 * mb), false, pollSlow}, // 1 MB/ms; at 50, 61 ms left
		{86, active(2954 * mb), false, pollFast}, // 6 MB/ms; at 50, 59 ms left
		{88, active(2955 * mb), false, pollFast}, // a new pass
		{108, active(31 * mb), false, pollFast},  // under pollNear
		{110, qmp.MigrateStatus{Status: "device"}, false, pollFast},
	} {
		if got := p.next(t0.Add(time.Duration(c.ms)*time.Millisecond), c.s, c.held); got != c.want {
			t.Errorf("poll %d at %d ms: next in %v, want %v", i, c.ms, got, c.want)
		}
	}
}
