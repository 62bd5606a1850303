package overlay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// Du returns the bytes path really takes on disk (st_blocks * 512): for a
// file its allocated blocks, for a directory the sum over its tree. Symlinks
// are not followed and a file with several hard links in the tree counts once.
func Du(path string) (int64, error) {
	type inode struct{ dev, ino uint64 }
	seen := map[inode]bool{}
	var total int64
	err := filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p != path {
				return nil // removed while walking
			}
			return err
		}
		st, ok := info.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("overlay: du %s: no stat data", p)
		}
		if st.Nlink > 1 && !info.IsDir() {
			k := inode{uint64(st.Dev), st.Ino}
			if seen[k] {
				return nil
			}
			seen[k] = true
		}
		total += st.Blocks * 512
		return nil
	})
	return total, err
}

// SyncDir fsyncs a directory so that entries created, renamed or removed in
// it survive a crash.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("overlay: fsync directory %s: %w", dir, err)
	}
	return nil
}

// SyncFile fsyncs the file at path, never through a link (a folder QEMU
// writes may hold one).
func SyncFile(path string) error {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// WriteFileAtomic replaces path with data so that after a crash path holds
// either its old content or all of data, never a part: it writes a temporary
// file in the same directory, fsyncs it, renames it over path and fsyncs the
// directory.
func WriteFileAtomic(path string, data []byte, perm fs.FileMode) (err error) {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	tmp, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err = tmp.Write(data); err != nil {
		return err
	}
	if err = tmp.Chmod(perm); err != nil {
		return err
	}
	if err = tmp.Sync(); err != nil {
		return err
	}
	if err = tmp.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	return SyncDir(dir)
}

// qcow2Header reads the fixed fields of a qcow2 header that kvbox reads
// without running qemu-img, for a caller on a short path: magic "QFI\xfb",
// version, backing_file_offset (u64), backing_file_size (u32),
// cluster_bits (u32), size (u64), all big-endian. ok is false when the
// file is no qcow2.
func qcow2Header(f *os.File) (h [32]byte, ok bool, err error) {
	if _, err := io.ReadFull(f, h[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return h, false, nil
		}
		return h, false, err
	}
	return h, string(h[:4]) == "QFI\xfb", nil
}

// BackingFile is the backing file named in the header of the qcow2 image
// at path, as stored ("" when it has none or is no qcow2).
func BackingFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h, ok, err := qcow2Header(f)
	if err != nil || !ok {
		return "", err
	}
	off, size := binary.BigEndian.Uint64(h[8:16]), binary.BigEndian.Uint32(h[16:20])
	if off == 0 || size == 0 {
		return "", nil
	}
	if size > 1023 { // qcow2's own limit
		return "", fmt.Errorf("%s: backing file name of %d bytes", path, size)
	}
	name := make([]byte, size)
	if _, err := f.ReadAt(name, int64(off)); err != nil {
		return "", fmt.Errorf("%s: backing file name: %w", path, err)
	}
	return string(name), nil
}

// VirtualSize is the size of the disk the qcow2 image at path holds, from
// its header.
func VirtualSize(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	h, ok, err := qcow2Header(f)
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, fmt.Errorf("%s: not a qcow2 image", path)
	}
	return int64(binary.BigEndian.Uint64(h[24:32])), nil
}
