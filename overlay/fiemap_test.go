package overlay

import (
	"os"
	"reflect"
	"testing"

	"golang.org/x/sys/unix"
)

func TestUnwrittenRanges(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "fiemap")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const k = 1 << 10
	// [0,1M) preallocated, 4K written and synced at 256K, [1M,3M) a hole.
	if err := unix.Fallocate(int(f.Fd()), 0, 0, 1<<20); err != nil {
		t.Skipf("fallocate on %s: %v", f.Name(), err)
	}
	buf := make([]byte, 4*k)
	buf[0] = 1
	if _, err := f.WriteAt(buf, 256*k); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(3 << 20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	got, ok, err := UnwrittenRanges(f)
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		t.Skipf("the filesystem of %s has no FIEMAP", f.Name())
	}
	want := []Extent{{0, 256 * k}, {260 * k, 3<<20 - 260*k}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("UnwrittenRanges = %v, want %v", got, want)
	}
}
