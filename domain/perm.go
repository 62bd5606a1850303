package domain

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/statedir"
)

// QEMUGID is the group QEMU runs as (libvirt's DAC base label), or 0
// when libvirt runs QEMU as root or reports no DAC label.
func (h *Host) QEMUGID() int {
	f, err := h.hostFacts()
	if err != nil || f.gid < 0 {
		return 0
	}
	return f.gid
}

// QEMUUID is the user QEMU runs as, or 0 like QEMUGID.
func (h *Host) QEMUUID() int {
	f, err := h.hostFacts()
	if err != nil || f.uid < 0 {
		return 0
	}
	return f.uid
}

// ShareWithQEMU makes path root-owned, group QEMU's, with mode: QEMU reads
// (or traverses) it through its group and cannot write or chmod it.
// Links are refused, never followed: the path is opened O_PATH|O_NOFOLLOW
// and changed through that descriptor, so a link QEMU's user swaps in after
// a check is not followed either.
func (h *Host) ShareWithQEMU(path string, mode fs.FileMode) error {
	fd, err := syscall.Open(path, unix_O_PATH|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return &fs.PathError{Op: "share with qemu", Path: path, Err: err}
	}
	defer syscall.Close(fd)
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return &fs.PathError{Op: "share with qemu", Path: path, Err: err}
	}
	if st.Mode&syscall.S_IFMT == syscall.S_IFLNK {
		return &fs.PathError{Op: "share with qemu", Path: path, Err: os.ErrInvalid}
	}
	if err := unix.Fchownat(fd, "", 0, h.QEMUGID(), unix.AT_EMPTY_PATH); err != nil {
		return &fs.PathError{Op: "share with qemu", Path: path, Err: err}
	}
	return os.Chmod("/proc/self/fd/"+strconv.Itoa(fd), mode)
}

// OpenNoFollow opens path, a plain file, in a folder QEMU's user can write
// (a box folder): a link planted there is refused, not followed, and so is
// anything but a regular file (a FIFO would block) or a file with another
// name elsewhere (a hard link). With O_CREATE a missing file is made with
// no permission bits: the caller sets them.
func OpenNoFollow(path string, flag int) (*os.File, error) {
	f, err := os.OpenFile(path, flag|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, err
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Nlink != 1 {
		f.Close()
		return nil, &fs.PathError{Op: "open", Path: path, Err: errors.New("not a plain file with one name (a link planted in a folder QEMU writes?)")}
	}
	return f, nil
}

// SecureStateDir sets the modes of the state dir and its fixed subfolders.
// Sealed snapshot and image folders made before their parent was setgid
// (an image imported into a new state dir before any command connected)
// get QEMU's group, so boxes and clones on them start.
func (h *Host) SecureStateDir() error {
	if err := h.ShareWithQEMU(h.StateDir, statedir.RootMode); err != nil {
		return err
	}
	l := h.Layout()
	for _, p := range l.Shared() {
		if err := os.MkdirAll(p, statedir.SharedDirMode); err != nil {
			return err
		}
		// setgid: what kvbox creates below (image imports, pulls) is QEMU's group too
		if err := h.ShareWithQEMU(p, statedir.SharedDirMode|os.ModeSetgid); err != nil {
			return err
		}
	}
	for _, p := range l.Private() {
		if st, err := os.Lstat(p); err == nil && st.IsDir() {
			if err := os.Chmod(p, statedir.PrivateDirMode); err != nil {
				return err
			}
		}
	}
	for _, dir := range []string{l.Snapshots(), l.Images()} {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
				continue // in-progress (.partial-*, .import-*) folders are QEMU's or a live kvbox's
			}
			h.shareSealed(filepath.Join(dir, e.Name()))
		}
	}
	return nil
}

// shareSealed gives QEMU's group to one sealed folder and its root-owned
// files that lack it (a folder QEMU owns is being written): QEMU reads
// them through its group.
func (h *Host) shareSealed(dir string) {
	st, err := os.Lstat(dir)
	if err != nil || !ownedByRoot(st) {
		return
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		fi, err := os.Lstat(p)
		switch {
		case err != nil:
		case fi.IsDir() && !strings.HasPrefix(e.Name(), "."):
			h.shareSealed(p) // an image's version folders
		case fi.Mode().IsRegular() && ownedByRoot(fi) && !h.qemuGroup(fi):
			h.ShareWithQEMU(p, statedir.SharedFileMode)
		}
	}
	if !h.qemuGroup(st) {
		h.ShareWithQEMU(dir, statedir.SharedDirMode)
	}
}

func ownedByRoot(fi fs.FileInfo) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && st.Uid == 0
}

// closeBoxDir takes the world bits off what QEMU and libvirt made in a box
// folder (agent sockets 0775, files from QEMU's umask). The folder
// is QEMU's, so a link may be planted: each entry is opened O_PATH|O_NOFOLLOW
// and changed through its descriptor, never by name.
func closeBoxDir(dir string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		fd, err := syscall.Open(filepath.Join(dir, e.Name()), unix_O_PATH|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		var st syscall.Stat_t
		if syscall.Fstat(fd, &st) == nil && st.Mode&syscall.S_IFMT != syscall.S_IFLNK && st.Mode&0o007 != 0 {
			syscall.Chmod("/proc/self/fd/"+strconv.Itoa(fd), st.Mode&0o7770)
		}
		syscall.Close(fd)
	}
}

const unix_O_PATH = 0o10000000

func (h *Host) qemuGroup(fi fs.FileInfo) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Gid) == h.QEMUGID()
}

// readNoFollow reads the regular file at path, refusing a symbolic link or
// anything else that is not a plain file (a FIFO would block).
func readNoFollow(path string) ([]byte, error) {
	f, err := OpenNoFollow(path, os.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}
