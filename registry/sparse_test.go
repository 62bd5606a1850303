package registry

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

func writeSparse(t *testing.T, path string, size int64, data map[int64][]byte) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for off, b := range data {
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
}

func TestSparseRoundTrip(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "memory")
	const size = 64 << 20
	page := bytes.Repeat([]byte("kvbox"), 1<<12)
	writeSparse(t, src, size, map[int64][]byte{0: page, 10 << 20: page, size - int64(len(page)): page})

	var a, b bytes.Buffer
	apparent, data, err := encodeSparse(src, &a)
	if err != nil {
		t.Fatal(err)
	}
	if apparent != size || data >= size/4 {
		t.Errorf("apparent %d data %d: holes were read", apparent, data)
	}
	if _, _, err := encodeSparse(src, &b); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("two encodings of the same file differ: a re-push would upload it again")
	}
	dst := filepath.Join(dir, "out")
	if err := decodeSparse(bytes.NewReader(a.Bytes()), dst, apparent, data); err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(src)
	got, _ := os.ReadFile(dst)
	if !bytes.Equal(want, got) {
		t.Fatal("decoded file differs")
	}
	if du, _ := duBytes(dst); du > 4<<20 {
		t.Errorf("decoded file takes %d bytes on disk: holes filled", du)
	}
	if err := decodeSparse(bytes.NewReader(a.Bytes()), dst, apparent, data); err == nil {
		t.Error("decode over an existing file succeeded")
	}
}

func TestSparseDecodeBad(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "f")
	writeSparse(t, src, 1<<20, map[int64][]byte{4096: []byte("hello")})
	var enc bytes.Buffer
	apparent, data, err := encodeSparse(src, &enc)
	if err != nil {
		t.Fatal(err)
	}
	for name, in := range map[string][]byte{
		"empty":     nil,
		"not zstd":  []byte("hello world"),
		"truncated": enc.Bytes()[:enc.Len()/2],
	} {
		if err := decodeSparse(bytes.NewReader(in), filepath.Join(dir, name), apparent, data); err == nil {
			t.Errorf("%s: decoded", name)
		}
	}
	// The whole part, but not the sizes its manifest declared.
	for name, sz := range map[string][2]int64{"larger": {apparent + 1, data}, "smaller": {apparent - 1, data}, "more data": {apparent, data + 1}} {
		if err := decodeSparse(bytes.NewReader(enc.Bytes()), filepath.Join(dir, name), sz[0], sz[1]); err == nil {
			t.Errorf("%s than declared: decoded", name)
		}
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			t.Errorf("%s than declared: a file was written", name)
		}
	}
}

// FuzzDecodeSparse: a part decodes to the file its manifest declared or
// not at all. decodeSmall and decodeSparse read the same header
// (readPartHeader); the fuzzer runs the one that writes no file.
func FuzzDecodeSparse(f *testing.F) {
	dir := f.TempDir()
	src := filepath.Join(dir, "f")
	f.Add([]byte("KVBXSPR1"))
	if fh, err := os.Create(src); err == nil {
		fh.Truncate(1 << 16)
		fh.WriteAt([]byte("x"), 100)
		fh.Close()
		var enc bytes.Buffer
		if _, _, err := encodeSparse(src, &enc); err == nil {
			f.Add(enc.Bytes())
		}
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if b, err := decodeSmall(bytes.NewReader(in), 1<<16, 4096); err == nil && len(b) != 1<<16 {
			t.Fatalf("decoded %d bytes, declared %d", len(b), 1<<16)
		}
	})
}

func duBytes(path string) (int64, error) {
	var st syscallStat
	return statBlocks(path, &st)
}
