package overlay

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
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
