package image

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
)

// agentPaths are where an image may carry kvbox-agent.
var agentPaths = []string{"/usr/local/bin/kvbox-agent", "/usr/bin/kvbox-agent", "/usr/sbin/kvbox-agent", "/sbin/kvbox-agent"}

// DetectAgent looks for kvbox-agent in a disk image: in a bare ext2/3/4
// filesystem, or in the ext filesystems of the partitions of an MBR or GPT
// disk. It answers "yes", "no" (ext filesystems were read and none has it),
// or "unknown" (no filesystem kvbox can read; other filesystems are not
// looked into). tmpDir holds a raw copy of a qcow2 while it looks.
func DetectAgent(ctx context.Context, disk, format, tmpDir string) (string, error) {
	raw := disk
	if format != "raw" {
		f, err := os.CreateTemp(tmpDir, ".detect-*.raw")
		if err != nil {
			return "", err
		}
		raw = f.Name()
		f.Close()
		defer os.Remove(raw)
		if out, err := exec.CommandContext(ctx, "qemu-img", "convert", "-O", "raw", disk, raw).CombinedOutput(); err != nil {
			return "", &toolError{"qemu-img convert", err, string(out)}
		}
	}
	f, err := os.Open(raw)
	if err != nil {
		return "", err
	}
	offsets := append([]int64{0}, partitionOffsets(f)...)
	f.Close()
	answer := "unknown"
	for _, off := range offsets {
		if !isExt(raw, off) {
			continue
		}
		answer = "no"
		for _, p := range agentPaths {
			cmd := exec.CommandContext(ctx, "debugfs", "-R", "stat "+p, raw+"?offset="+strconv.FormatInt(off, 10))
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			if out, err := cmd.Output(); err == nil && bytes.Contains(out, []byte("Inode:")) {
				return "yes", nil
			}
		}
	}
	return answer, nil
}

type toolError struct {
	tool   string
	err    error
	output string
}

func (e *toolError) Error() string {
	return e.tool + ": " + e.err.Error() + ": " + string(bytes.TrimSpace([]byte(e.output)))
}

// isExt reports whether an ext2/3/4 superblock starts 1024 bytes past off.
func isExt(path string, off int64) bool {
	f, err := os.Open(filepath.Clean(path))
	if err != nil {
		return false
	}
	defer f.Close()
	var magic [2]byte
	if _, err := f.ReadAt(magic[:], off+1024+56); err != nil {
		return false
	}
	return binary.LittleEndian.Uint16(magic[:]) == 0xEF53
}

// partitionOffsets reads an MBR or GPT partition table and returns the
// byte offsets of the partitions (512-byte sectors).
func partitionOffsets(r io.ReaderAt) []int64 {
	var mbr [512]byte
	if _, err := r.ReadAt(mbr[:], 0); err != nil || mbr[510] != 0x55 || mbr[511] != 0xAA {
		return nil
	}
	var out []int64
	for i := 0; i < 4; i++ {
		e := mbr[446+16*i : 446+16*(i+1)]
		typ, start := e[4], binary.LittleEndian.Uint32(e[8:12])
		switch {
		case typ == 0xEE:
			return gptOffsets(r)
		case typ != 0 && start != 0:
			out = append(out, int64(start)*512)
		}
	}
	return out
}

func gptOffsets(r io.ReaderAt) []int64 {
	var hdr [92]byte
	if _, err := r.ReadAt(hdr[:], 512); err != nil || string(hdr[:8]) != "EFI PART" {
		return nil
	}
	entriesLBA := binary.LittleEndian.Uint64(hdr[72:80])
	count := binary.LittleEndian.Uint32(hdr[80:84])
	size := binary.LittleEndian.Uint32(hdr[84:88])
	if size < 128 || size > 4096 || count > 1024 || entriesLBA > 1<<40 {
		return nil
	}
	var out []int64
	e := make([]byte, size)
	for i := uint32(0); i < count; i++ {
		if _, err := r.ReadAt(e, int64(entriesLBA)*512+int64(i)*int64(size)); err != nil {
			break
		}
		if first := binary.LittleEndian.Uint64(e[32:40]); !bytes.Equal(e[:16], make([]byte, 16)) && first < 1<<40 {
			out = append(out, int64(first)*512)
		}
	}
	return out
}
