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

// BackingFile is the backing file named in the header of the qcow2 image
// at path, as stored ("" when it has none or is no qcow2): the header's
// fixed fields, read without running qemu-img, for a caller on a short
// path (kvbox rm).
func BackingFile(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	// magic "QFI\xfb", version, backing_file_offset (u64), backing_file_size (u32): big-endian
	var h [20]byte
	if _, err := io.ReadFull(f, h[:]); err != nil || string(h[:4]) != "QFI\xfb" {
		return "", nil
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
