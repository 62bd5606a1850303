package image

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"kvbox.dev/kvbox/testenv/gate"
)

// mkfs builds a small ext4 image from a folder, as the image builders do.
func mkfs(t *testing.T, root, out string) {
	t.Helper()
	gate.Tools(t, "mkfs.ext4") // e2fsprogs is a dependency of the test bench
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-d", root, out, "16M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 -d: %v %s", err, out)
	}
}

func TestDetectAgent(t *testing.T) {
	dir := t.TempDir()
	with, without := filepath.Join(dir, "with"), filepath.Join(dir, "without")
	os.MkdirAll(filepath.Join(with, "usr/local/bin"), 0o755)
	os.WriteFile(filepath.Join(with, "usr/local/bin/kvbox-agent"), []byte("\x7fELF"), 0o755)
	os.MkdirAll(filepath.Join(without, "usr/bin"), 0o755)
	mkfs(t, with, filepath.Join(dir, "with.raw"))
	mkfs(t, without, filepath.Join(dir, "without.raw"))
	if out, err := exec.Command("qemu-img", "convert", "-O", "qcow2", filepath.Join(dir, "with.raw"), filepath.Join(dir, "with.qcow2")).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v %s", err, out)
	}
	os.WriteFile(filepath.Join(dir, "blank.raw"), make([]byte, 1<<20), 0o644)
	for _, tc := range []struct{ disk, format, want string }{
		{"with.raw", "raw", "yes"},
		{"with.qcow2", "qcow2", "yes"},
		{"without.raw", "raw", "no"},
		{"blank.raw", "raw", "unknown"},
	} {
		got, err := DetectAgent(context.Background(), filepath.Join(dir, tc.disk), tc.format, dir)
		if err != nil || got != tc.want {
			t.Errorf("DetectAgent(%s) = %q, %v; want %q", tc.disk, got, err, tc.want)
		}
	}
}

func TestPartitionOffsets(t *testing.T) {
	disk := make([]byte, 64<<10)
	disk[510], disk[511] = 0x55, 0xAA
	e := disk[446:]
	e[4] = 0x83
	binary.LittleEndian.PutUint32(e[8:], 2048)
	if got := partitionOffsets(bytes.NewReader(disk)); len(got) != 1 || got[0] != 2048*512 {
		t.Errorf("MBR: %v", got)
	}
	// GPT: protective MBR, header at LBA 1, entries at LBA 2.
	e[4] = 0xEE
	copy(disk[512:], "EFI PART")
	binary.LittleEndian.PutUint64(disk[512+72:], 2)
	binary.LittleEndian.PutUint32(disk[512+80:], 4)
	binary.LittleEndian.PutUint32(disk[512+84:], 128)
	ent := disk[1024:]
	ent[0] = 1 // a non-zero type GUID
	binary.LittleEndian.PutUint64(ent[32:], 4096)
	if got := partitionOffsets(bytes.NewReader(disk)); len(got) != 1 || got[0] != 4096*512 {
		t.Errorf("GPT: %v", got)
	}
}

func FuzzPartitionOffsets(f *testing.F) {
	f.Add(make([]byte, 1024))
	f.Fuzz(func(t *testing.T, b []byte) { partitionOffsets(bytes.NewReader(b)) })
}
