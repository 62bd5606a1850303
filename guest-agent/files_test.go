package agent

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func mkTree(t *testing.T, dir string) string {
	src := filepath.Join(dir, "src")
	for _, d := range []string{"src", "src/sub", "src/ro"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(src, "run.sh"), []byte("#!/bin/sh\necho hi\n"), 0o755)
	os.WriteFile(filepath.Join(src, "sub", "secret"), []byte("s"), 0o600)
	os.WriteFile(filepath.Join(src, "ro", "f"), bytes.Repeat([]byte("x"), 3<<20), 0o644)
	os.Symlink("../run.sh", filepath.Join(src, "sub", "link"))
	os.Chmod(filepath.Join(src, "sub", "secret"), 0o4600)
	old := time.Date(2020, 1, 2, 3, 4, 5, 600, time.UTC)
	for _, p := range []string{"run.sh", "sub/secret", "ro/f", "ro", "sub", "."} {
		if err := os.Chtimes(filepath.Join(src, p), old, old); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(filepath.Join(src, "ro"), 0o555)
	return src
}

func tarOf(t testing.TB, src string) []byte {
	var b bytes.Buffer
	if err := WriteTree(&b, src, nil); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func TestTreeRoundTrip(t *testing.T) {
	dir := t.TempDir()
	src := mkTree(t, dir)
	stream := tarOf(t, src)
	dstDir := filepath.Join(dir, "dst")
	os.Mkdir(dstDir, 0o755)
	final, err := ExtractTree(bytes.NewReader(stream), dstDir)
	if err != nil || final != filepath.Join(dstDir, "src") {
		t.Fatalf("ExtractTree = %q, %v", final, err)
	}
	for _, p := range []string{".", "run.sh", "sub", "sub/secret", "sub/link", "ro", "ro/f"} {
		a, _ := os.Lstat(filepath.Join(src, p))
		b, err := os.Lstat(filepath.Join(final, p))
		if err != nil {
			t.Fatal(err)
		}
		if a.Mode() != b.Mode() || a.Size() != b.Size() {
			t.Errorf("%s: mode %v size %d, want %v %d", p, b.Mode(), b.Size(), a.Mode(), a.Size())
		}
		if a.Mode()&os.ModeSymlink == 0 && !a.ModTime().Equal(b.ModTime()) {
			t.Errorf("%s: mtime %v, want %v", p, b.ModTime(), a.ModTime())
		}
	}
	if l, _ := os.Readlink(filepath.Join(final, "sub/link")); l != "../run.sh" {
		t.Errorf("link -> %q", l)
	}
	// Again onto the existing tree: merged, nothing temporary left.
	os.WriteFile(filepath.Join(final, "extra"), nil, 0o644)
	if _, err := ExtractTree(bytes.NewReader(stream), dstDir); err != nil {
		t.Fatalf("second copy onto the tree: %v", err)
	}
	if _, err := os.Stat(filepath.Join(final, "extra")); err != nil {
		t.Errorf("merge removed a file: %v", err)
	}
	assertNoTemp(t, dir)

	// As a new name; a file onto a file; a file into a directory.
	if final, err := ExtractTree(bytes.NewReader(stream), filepath.Join(dstDir, "renamed")); err != nil || final != filepath.Join(dstDir, "renamed") {
		t.Errorf("to a new name: %q %v", final, err)
	}
	f := tarOf(t, filepath.Join(src, "run.sh"))
	os.WriteFile(filepath.Join(dstDir, "file"), []byte("old"), 0o644)
	if final, err := ExtractTree(bytes.NewReader(f), filepath.Join(dstDir, "file")); err != nil || final != filepath.Join(dstDir, "file") {
		t.Errorf("file onto a file: %q %v", final, err)
	}
	if b, _ := os.ReadFile(filepath.Join(dstDir, "file")); string(b) != "#!/bin/sh\necho hi\n" {
		t.Errorf("file onto a file: %q", b)
	}
	assertNoTemp(t, dir)
}

func assertNoTemp(t *testing.T, dir string) {
	t.Helper()
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil && strings.HasPrefix(fi.Name(), tmpPrefix) {
			t.Errorf("left behind: %s", p)
		}
		return nil
	})
}

func TestExtractRefusals(t *testing.T) {
	dir := t.TempDir()
	src := mkTree(t, dir)
	stream := tarOf(t, src)
	file := filepath.Join(dir, "plain")
	os.WriteFile(file, nil, 0o644)
	for dst, want := range map[string]string{
		filepath.Join(dir, "nodir", "x"):    "nodir: no such file or directory",
		filepath.Join(dir, "missing") + "/": "missing/: no such file or directory",
		file:                                "plain: not a directory",
		filepath.Join(file, "x"):            "plain: not a directory",
	} {
		_, err := ExtractTree(bytes.NewReader(stream), dst)
		if err == nil || !strings.HasSuffix(err.Error(), want) {
			t.Errorf("ExtractTree to %s: %v, want …%q", dst, err, want)
		}
	}
	if _, err := ExtractTree(bytes.NewReader(stream), filepath.Join(dir, "nodir", "x")); !errors.Is(err, ErrPathNotFound) {
		t.Errorf("missing parent is not ErrPathNotFound: %v", err)
	}
	// A stream cut short leaves nothing at the destination.
	out := filepath.Join(dir, "out")
	os.Mkdir(out, 0o755)
	if _, err := ExtractTree(bytes.NewReader(stream[:len(stream)/2]), out); err == nil {
		t.Error("a truncated stream was accepted")
	}
	if ents, _ := os.ReadDir(out); len(ents) != 0 {
		t.Errorf("a truncated stream left %v", ents)
	}
	// Entries that would escape, through .. or through a symlink.
	for _, entries := range [][]tar.Header{
		{{Name: "top/", Typeflag: tar.TypeDir, Mode: 0o755}, {Name: "top/../../evil", Typeflag: tar.TypeReg}},
		{{Name: "top/", Typeflag: tar.TypeDir, Mode: 0o755}, {Name: "top/l", Typeflag: tar.TypeSymlink, Linkname: dir}, {Name: "top/l/evil", Typeflag: tar.TypeReg}},
		{{Name: "top/", Typeflag: tar.TypeDir, Mode: 0o755}, {Name: "other/evil", Typeflag: tar.TypeReg}},
	} {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, h := range entries {
			tw.WriteHeader(&h)
		}
		tw.Close()
		if _, err := ExtractTree(bytes.NewReader(b.Bytes()), out); err == nil {
			t.Errorf("stream %v was accepted", entries)
		}
		if _, err := os.Lstat(filepath.Join(dir, "evil")); err == nil {
			t.Fatalf("stream %v wrote outside the destination", entries)
		}
	}
	if ents, _ := os.ReadDir(out); len(ents) != 0 {
		t.Errorf("refused streams left %v", ents)
	}
	if err := WriteTree(io.Discard, filepath.Join(dir, "nope"), nil); !errors.Is(err, ErrPathNotFound) {
		t.Errorf("WriteTree of a missing path: %v", err)
	}
}
