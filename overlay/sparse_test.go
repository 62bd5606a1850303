package overlay

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
)

// DataExtents finds what a sparse file holds without reading it.
func TestDataExtents(t *testing.T) {
	p := filepath.Join(t.TempDir(), "memory")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const mib = 1 << 20
	if err := f.Truncate(8 * mib); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{1 * mib, 2 * mib, 5 * mib} {
		if _, err := f.WriteAt(bytes.Repeat([]byte{7}, mib), off); err != nil {
			t.Fatal(err)
		}
	}
	data, size, err := DataExtents(f)
	if err != nil {
		t.Fatal(err)
	}
	want := []Extent{{1 * mib, 2 * mib}, {5 * mib, mib}}
	if size != 8*mib || !reflect.DeepEqual(data, want) {
		t.Fatalf("DataExtents = %v, %d; want %v, %d", data, size, want, 8*mib)
	}
}

// CopyRangeSparse copies a range of one file to the start of another,
// skipping holes and zero pages (a suspended clone's RAM out of its
// mapped-ram state file).
func TestCopyRangeSparse(t *testing.T) {
	dir := t.TempDir()
	in, err := os.Create(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	const page, head = 4096, 8192
	fill := func(b byte) []byte { return bytes.Repeat([]byte{b}, page) }
	in.WriteAt(fill(9), 0)                    // header: not copied
	in.WriteAt(fill(1), head)                 // page 0
	in.WriteAt(make([]byte, page), head+page) // page 1: written zeros
	in.WriteAt(fill(4), head+3*page)          // page 3 (page 2 a hole)
	in.WriteAt(fill(5), head+4*page)          // past the range: not copied
	out, err := os.Create(filepath.Join(dir, "memory"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if err := out.Truncate(4 * page); err != nil {
		t.Fatal(err)
	}
	out.WriteAt(fill(7), page) // where in has zeros: left as it is
	n, err := CopyRangeSparse(out, in, head, 4*page)
	if err != nil {
		t.Fatal(err)
	}
	if n != 2*page {
		t.Errorf("copied %d bytes, want %d", n, 2*page)
	}
	got, err := os.ReadFile(out.Name())
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Concat(fill(1), fill(7), make([]byte, page), fill(4))
	if !bytes.Equal(got, want) {
		t.Errorf("out's pages start with %v %v %v %v, want 1 7 0 4", got[0], got[page], got[2*page], got[3*page])
	}
}
