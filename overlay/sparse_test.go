package overlay

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// DataExtents finds what a sparse file holds without reading it, and Holes
// is the rest: a box's untouched RAM.
func TestDataExtentsAndHoles(t *testing.T) {
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
	holes := Holes(data, size)
	if want := []Extent{{0, mib}, {3 * mib, 2 * mib}, {6 * mib, 2 * mib}}; !reflect.DeepEqual(holes, want) {
		t.Fatalf("Holes = %v, want %v", holes, want)
	}
	if h := Holes(nil, 4*mib); !reflect.DeepEqual(h, []Extent{{0, 4 * mib}}) {
		t.Fatalf("Holes of an empty file = %v", h)
	}
	if h := Holes([]Extent{{0, 4 * mib}}, 4*mib); h != nil {
		t.Fatalf("Holes of a full file = %v", h)
	}
}
