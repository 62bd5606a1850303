package overlay

import (
	"bytes"
	"context"
	"errors"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"kvbox.dev/kvbox/testenv/gate"
)

func needTools(t *testing.T) {
	t.Helper()
	gate.Tools(t, "qemu-img", "qemu-io")
}

func qemuIO(t *testing.T, path string, cmds ...string) error {
	t.Helper()
	args := []string{"-f", "qcow2"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, err := exec.Command("qemu-io", append(args, path)...).CombinedOutput()
	// qemu-io exits 0 even when a pattern check fails; it says so.
	if err == nil && (strings.Contains(string(out), "Pattern verification failed") || strings.Contains(string(out), "failed")) {
		err = errors.New("qemu-io reported a failure")
	}
	if err != nil {
		return errors.New(err.Error() + ": " + string(out))
	}
	return nil
}

// makeChain makes base (16 MiB, 1 MiB of 0x11), snap1 above it (64 KiB
// of 0xab at 0) and snap2 above that (64 KiB of 0xcd at 512 KiB) in dir.
func makeChain(ctx context.Context, t *testing.T, dir string) (base, snap1, snap2 string) {
	t.Helper()
	base = filepath.Join(dir, "base.qcow2")
	snap1 = filepath.Join(dir, "snap1.qcow2")
	snap2 = filepath.Join(dir, "snap2.qcow2")
	if err := CreateSized(ctx, base, 16<<20); err != nil {
		t.Fatal(err)
	}
	if err := qemuIO(t, base, "write -P 0x11 0 1M"); err != nil {
		t.Fatal(err)
	}
	if err := Create(ctx, snap1, base, "qcow2"); err != nil {
		t.Fatal(err)
	}
	if err := qemuIO(t, snap1, "write -P 0xab 0 64k"); err != nil {
		t.Fatal(err)
	}
	if err := Create(ctx, snap2, snap1, "qcow2"); err != nil {
		t.Fatal(err)
	}
	if err := qemuIO(t, snap2, "write -P 0xcd 512k 64k"); err != nil {
		t.Fatal(err)
	}
	return base, snap1, snap2
}

func TestOverlayLifecycle(t *testing.T) {
	needTools(t)
	ctx := context.Background()
	base, snap1, snap2 := makeChain(ctx, t, t.TempDir())

	info, err := Info(ctx, snap2)
	if err != nil {
		t.Fatal(err)
	}
	if info.Format != "qcow2" || info.VirtualSize != 16<<20 || info.BackingFile != snap1 ||
		info.BackingFormat != "qcow2" || info.ActualSize <= 0 {
		t.Fatalf("info %+v", info)
	}
	chain, err := InfoChain(ctx, snap2)
	if err != nil {
		t.Fatal(err)
	}
	if len(chain) != 3 || chain[0].Filename != snap2 || chain[1].Filename != snap1 || chain[2].Filename != base || chain[2].BackingFile != "" {
		t.Fatalf("chain %+v", chain)
	}

	// Safe rebase of snap2 onto base merges snap1's data into it, so snap1
	// can go.
	if err := Rebase(ctx, snap2, base, "qcow2", false); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(snap1); err != nil {
		t.Fatal(err)
	}
	if err := qemuIO(t, snap2, "read -P 0xab 0 64k", "read -P 0xcd 512k 64k", "read -P 0x11 64k 448k"); err != nil {
		t.Fatal(err)
	}
	if info, err := Info(ctx, snap2); err != nil || info.BackingFile != base {
		t.Fatalf("after rebase: %+v, %v", info, err)
	}

	// Fully standalone.
	if err := Rebase(ctx, snap2, "", "", false); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(base); err != nil {
		t.Fatal(err)
	}
	if err := qemuIO(t, snap2, "read -P 0xab 0 64k", "read -P 0xcd 512k 64k", "read -P 0x11 64k 448k", "read -P 0 2M 64k"); err != nil {
		t.Fatal(err)
	}

	if err := Resize(ctx, snap2, 32<<20); err != nil {
		t.Fatal(err)
	}
	if info, err := Info(ctx, snap2); err != nil || info.VirtualSize != 32<<20 || info.BackingFile != "" {
		t.Fatalf("after resize: %+v, %v", info, err)
	}
	err = Resize(ctx, snap2, 1<<20)
	var ie *ImgError
	if !errors.As(err, &ie) || !strings.Contains(err.Error(), "shrink") {
		t.Fatalf("shrinking resize: %v", err)
	}
	if res, err := Check(ctx, snap2); err != nil || res.Corruptions != 0 {
		t.Fatalf("check: %+v, %v", res, err)
	}
}

func TestQemuImgErrors(t *testing.T) {
	needTools(t)
	ctx := context.Background()
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.qcow2")
	err := Create(ctx, filepath.Join(dir, "o.qcow2"), missing, "qcow2")
	var ie *ImgError
	if !errors.As(err, &ie) || ie.Stderr == "" || !strings.Contains(err.Error(), "missing.qcow2") {
		t.Fatalf("create on a missing backing file: %v", err)
	}
	if _, err := Info(ctx, missing); err == nil {
		t.Fatal("info of a missing file succeeded")
	}
	tests := []struct {
		name string
		err  error
	}{
		{"create without format", Create(ctx, filepath.Join(dir, "x"), "b", "")},
		{"create zero size", CreateSized(ctx, filepath.Join(dir, "x"), 0)},
		{"rebase without format", Rebase(ctx, filepath.Join(dir, "x"), "b", "", false)},
		{"resize negative", Resize(ctx, filepath.Join(dir, "x"), -1)},
	}
	for _, tt := range tests {
		if tt.err == nil {
			t.Errorf("%s: no error", tt.name)
		}
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := CreateSized(cctx, filepath.Join(dir, "c.qcow2"), 1<<20); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled context: %v", err)
	}
}

func TestCheckCorrupt(t *testing.T) {
	needTools(t)
	ctx := context.Background()
	img := filepath.Join(t.TempDir(), "c.qcow2")
	if err := CreateSized(ctx, img, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := qemuIO(t, img, "write -P 0x22 0 64k"); err != nil {
		t.Fatal(err)
	}
	// Point the first L1 entry at an offset past the end of the file.
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	hdr := make([]byte, 48)
	if _, err := f.ReadAt(hdr, 0); err != nil {
		t.Fatal(err)
	}
	l1 := int64(hdr[40])<<56 | int64(hdr[41])<<48 | int64(hdr[42])<<40 | int64(hdr[43])<<32 |
		int64(hdr[44])<<24 | int64(hdr[45])<<16 | int64(hdr[46])<<8 | int64(hdr[47])
	if _, err := f.WriteAt([]byte{0x80, 0, 0, 0, 0x7f, 0, 0x02, 0}, l1); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, err := Check(ctx, img); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("check of a corrupt image: %v", err)
	}
}

func blocks(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func TestCopySparse(t *testing.T) {
	for _, cfr := range []bool{true, false} {
		name := "copy_file_range"
		if !cfr {
			name = "write"
		}
		t.Run(name, func(t *testing.T) {
			old := useCopyFileRange
			useCopyFileRange = cfr
			defer func() { useCopyFileRange = old }()
			testCopySparse(t)
		})
	}
}

func testCopySparse(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "memory")
	dst := filepath.Join(dir, "copy")
	const size = 64<<20 + 1234 // not page aligned, ends in a hole
	f, err := os.OpenFile(src, os.O_RDWR|os.O_CREATE, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	rnd := rand.New(rand.NewSource(1))
	random := func(n int) []byte { b := make([]byte, n); rnd.Read(b); return b }
	var data int64
	writes := []struct {
		off int64
		b   []byte
	}{
		{0, random(4096)},
		{10 << 20, random(100 << 10)},
		{40<<20 + 123, random(777)}, // unaligned, inside one page
		// Allocated zeros, as QEMU leaves in a RAM file, with one byte set
		// in the middle: only that page should be copied.
		{20 << 20, make([]byte, 8<<20)},
		{24<<20 + 5, []byte{1}},
		{size - 10, []byte("tail bytes")},
	}
	for _, w := range writes {
		if _, err := f.WriteAt(w.b, w.off); err != nil {
			t.Fatal(err)
		}
	}
	data = 4096 + 100<<10 + 4096 + 4096 + 4096
	f.Close()
	if b := blocks(t, src); b < 8<<20 {
		t.Fatalf("source should have the zero region allocated, has %d bytes", b)
	}

	// A stale, bigger dst is replaced.
	if err := os.WriteFile(dst, bytes.Repeat([]byte{0xff}, 70<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	written, err := CopySparse(dst, src)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src)
	b, _ := os.ReadFile(dst)
	if !bytes.Equal(a, b) {
		t.Fatal("copy differs from the source")
	}
	st, _ := os.Stat(dst)
	if st.Size() != size || st.Mode().Perm() != 0o600 && st.Mode().Perm() != 0o640 {
		t.Fatalf("copy size %d mode %v", st.Size(), st.Mode())
	}
	if written > data+8192 || written == 0 {
		t.Errorf("written %d, want about %d", written, data)
	}
	if used := blocks(t, dst); used > data+64<<10 {
		t.Errorf("copy takes %d bytes on disk, want about %d", used, data)
	}
	if du, err := Du(dst); err != nil || du != blocks(t, dst) {
		t.Errorf("Du = %d, %v", du, err)
	}
}

func TestCopySparseEmptyAndErrors(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "empty")
	if err := os.WriteFile(src, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if n, err := CopySparse(filepath.Join(dir, "copy"), src); err != nil || n != 0 {
		t.Fatalf("empty file: %d, %v", n, err)
	}
	if err := os.WriteFile(src, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := CopySparse(src, src); err == nil {
		t.Fatal("copying a file onto itself succeeded")
	}
	if b, _ := os.ReadFile(src); string(b) != "keep" {
		t.Fatalf("copy onto itself destroyed the file: %q", b)
	}
	if _, err := CopySparse(filepath.Join(dir, "c2"), dir); err == nil {
		t.Fatal("copying a directory succeeded")
	}
	if _, err := CopySparse(filepath.Join(dir, "c3"), filepath.Join(dir, "nope")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing source: %v", err)
	}
}

func TestDu(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "a", "b"), 0o755); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "a", "b", "f")
	if err := os.WriteFile(big, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	// A hard link is counted once, a sparse file by its blocks.
	if err := os.Link(big, filepath.Join(dir, "a", "link")); err != nil {
		t.Fatal(err)
	}
	sp, err := os.Create(filepath.Join(dir, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	sp.Truncate(1 << 30)
	sp.Close()
	if err := os.Symlink("/usr", filepath.Join(dir, "sym")); err != nil {
		t.Fatal(err)
	}
	total, err := Du(dir)
	if err != nil {
		t.Fatal(err)
	}
	if total < 1<<20 || total > 1<<20+64<<10 {
		t.Errorf("Du(dir) = %d, want about 1 MiB", total)
	}
	if _, err := Du(filepath.Join(dir, "missing")); err == nil {
		t.Error("Du of a missing path succeeded")
	}
}

func TestWriteFileAtomic(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "domain.xml")
	for _, content := range []string{"first", "second, longer"} {
		if err := WriteFileAtomic(p, []byte(content), 0o640); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(p)
		if err != nil || string(got) != content {
			t.Fatalf("read %q, %v", got, err)
		}
	}
	st, _ := os.Stat(p)
	if st.Mode().Perm() != 0o640 {
		t.Errorf("mode %v", st.Mode())
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("temporary files left: %v", entries)
	}
	if err := WriteFileAtomic(filepath.Join(dir, "nodir", "f"), nil, 0o600); err == nil {
		t.Error("write into a missing directory succeeded")
	}
	if err := SyncDir(dir); err != nil {
		t.Error(err)
	}
}

func TestCreateLarger(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	if err := CreateSized(ctx, base, 1<<20); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ size, want int64 }{{0, 1 << 20}, {8 << 20, 8 << 20}} {
		o := filepath.Join(dir, "o.qcow2")
		os.Remove(o)
		if err := CreateLarger(ctx, o, base, "qcow2", tc.size); err != nil {
			t.Fatal(err)
		}
		info, err := Info(ctx, o)
		if err != nil || info.VirtualSize != tc.want || info.BackingFile != base {
			t.Errorf("size %d: %+v, %v", tc.size, info, err)
		}
	}
}

// BackingFile and VirtualSize read what qemu-img info says, from the
// header alone.
func TestBackingFile(t *testing.T) {
	needTools(t)
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	top := filepath.Join(dir, "top.qcow2")
	if err := CreateSized(ctx, base, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := Create(ctx, top, base, "qcow2"); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{top: base, base: ""} {
		info, err := Info(ctx, path)
		if err != nil {
			t.Fatal(err)
		}
		got, err := BackingFile(path)
		if err != nil || got != want || got != info.BackingFile {
			t.Errorf("BackingFile(%s) = %q, %v; want %q (qemu-img: %q)", filepath.Base(path), got, err, want, info.BackingFile)
		}
		if size, err := VirtualSize(path); err != nil || size != info.VirtualSize || size != 1<<20 {
			t.Errorf("VirtualSize(%s) = %d, %v; qemu-img says %d", filepath.Base(path), size, err, info.VirtualSize)
		}
	}
	raw := filepath.Join(dir, "raw")
	os.WriteFile(raw, bytes.Repeat([]byte{1}, 4096), 0o644)
	if got, err := BackingFile(raw); got != "" || err != nil {
		t.Errorf("BackingFile(raw) = %q, %v; want none", got, err)
	}
	if _, err := VirtualSize(raw); err == nil {
		t.Error("VirtualSize(raw): no error")
	}
	if _, err := BackingFile(filepath.Join(dir, "none")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("BackingFile(missing) = %v", err)
	}
}
