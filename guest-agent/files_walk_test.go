package agent

import (
	"archive/tar"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A user who owns part of a tree swaps a directory for a link to what
// they may not read while root copies the tree into a box: the walk, from
// directory handles, never follows it.
func TestWriteTreeWalksHandles(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	os.Mkdir(secret, 0o700)
	os.WriteFile(filepath.Join(secret, "key"), []byte("SECRET-KEY"), 0o600)
	src := filepath.Join(dir, "tree")
	os.MkdirAll(filepath.Join(src, "b"), 0o755)
	os.WriteFile(filepath.Join(src, "a"), []byte("SWAP-NOW"), 0o644)
	os.WriteFile(filepath.Join(src, "b", "key"), []byte("harmless"), 0o644)

	// The swap happens while a's content is being sent, after the walk
	// listed the tree and before it reached b.
	w := &swapWriter{on: []byte("SWAP-NOW"), swap: func() {
		os.RemoveAll(filepath.Join(src, "b"))
		if err := os.Symlink(secret, filepath.Join(src, "b")); err != nil {
			t.Error(err)
		}
	}}
	err := WriteTree(w, src, nil)
	if !w.swapped {
		t.Fatal("the walk never sent a")
	}
	if bytes.Contains(w.buf.Bytes(), []byte("SECRET-KEY")) {
		t.Fatalf("the stream holds the content of a file behind the swapped link")
	}
	if err != nil && !strings.Contains(err.Error(), "changed while being copied") {
		t.Fatalf("WriteTree: %v", err)
	}
	if err == nil {
		tr := tar.NewReader(bytes.NewReader(w.buf.Bytes()))
		var names []string
		for {
			h, err := tr.Next()
			if err != nil {
				break
			}
			names = append(names, fmt.Sprintf("%s:%c", h.Name, h.Typeflag))
		}
		if got := strings.Join(names, " "); got != "tree/:5 tree/a:0 tree/b:2" {
			t.Errorf("stream: %s", got)
		}
	}
}

type swapWriter struct {
	buf     bytes.Buffer
	on      []byte
	swap    func()
	swapped bool
}

func (s *swapWriter) Write(b []byte) (int, error) {
	s.buf.Write(b)
	if !s.swapped && bytes.Contains(s.buf.Bytes(), s.on) {
		s.swapped = true
		s.swap()
	}
	return len(b), nil
}
