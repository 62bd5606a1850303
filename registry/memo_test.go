package registry

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// A part the memo knows is encoded again, to the same digest, when its
// blob was pruned; a memo entry that no longer matches the file is an
// error that forgets the entry, never a blob under a wrong digest.
func TestMemoReencodesPrunedBlobsExactly(t *testing.T) {
	dir := t.TempDir()
	c := cache{filepath.Join(dir, "cache")}
	path := filepath.Join(dir, "part")
	data := []byte(strings.Repeat("kvbox snapshot part ", 50000))
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	m := loadMemo(c)
	fi, _ := os.Stat(path)
	key := memoKey(path, fi)
	dig, n, err := c.put(func(w io.Writer) error { _, _, err := encodeSparse(path, w); return err })
	if err != nil {
		t.Fatal(err)
	}
	m.put(key, memoEntry{Digest: dig.String(), Blob: n})
	if err := m.save(); err != nil {
		t.Fatal(err)
	}
	if e, ok := loadMemo(c).get(key); !ok || e.Digest != dig.String() {
		t.Fatalf("memo not saved: %+v %v", e, ok)
	}
	os.Remove(c.blob(dig)) // pruned after the push
	if err := c.ensureBlob(m, key, path, dig, n); err != nil {
		t.Fatalf("re-encode: %v", err)
	}
	if fi, err := os.Stat(c.blob(dig)); err != nil || fi.Size() != n {
		t.Fatalf("blob not back: %v", err)
	}
	wrong := v1.Hash{Algorithm: "sha256", Hex: strings.Repeat("0", 64)}
	m.put(key, memoEntry{Digest: wrong.String(), Blob: n})
	if err := c.ensureBlob(m, key, path, wrong, n); err == nil {
		t.Fatal("a memo entry that does not match the file was trusted")
	}
	if _, ok := m.get(key); ok {
		t.Error("the wrong entry was kept")
	}
	if _, err := os.Stat(c.blob(wrong)); err == nil {
		t.Error("a blob was stored under a digest it does not have")
	}
	// A changed file has another key.
	os.WriteFile(path, append(data, 'x'), 0o600)
	fi2, _ := os.Stat(path)
	if memoKey(path, fi2) == key {
		t.Error("a changed file keeps its memo key")
	}
}
