package domain

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/overlay"
)

// qemuPID is the pid of a running box's QEMU from libvirt's pid file,
// checked against the process's command line (guest=NAME,) so that a pid
// reused by another process is never taken for it; 0 if there is none.
func qemuPID(name string) int {
	if strings.ContainsAny(name, "/\x00") {
		return 0
	}
	b, err := os.ReadFile(filepath.Join(qemuPidDir, name+".pid"))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return 0
	}
	cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmd), "guest="+QemuOptEscape(name)+",") {
		return 0
	}
	return pid
}

// DropUntouchedRAM gives back the page cache that a full read of a running
// box's shared RAM file put where the file holds nothing written to disk.
// A live snapshot reads every page of the guest's memory, and a read of a
// hole or a preallocated (unwritten) extent of a shared file mapping fills
// the page cache with a page of zeros (a 4 GiB box with 1.5 GB touched
// would hold 2.5 GB more of it, and SEEK_DATA would call it data). The
// ranges are the file's unwritten ones now (overlay.UnwrittenRanges), so
// what a copy killed half-way left goes too. The kernel is asked to page
// them out of QEMU (MADV_PAGEOUT through process_madvise), which unmaps
// them there, and then out of the page cache (POSIX_FADV_DONTNEED on the
// file): MADV_PAGEOUT alone left all 2.5 GB cached here (kernel 6.18), the
// fadvise freed them. Nothing the guest wrote is lost: a clean page in an
// unwritten range can only be zeros (a page written to disk makes its
// extent written), and a dirty page is never dropped by either call. It
// returns how many bytes of ranges were advised.
func DropUntouchedRAM(name, dir string) (int64, error) {
	pid := qemuPID(name)
	if pid == 0 {
		return 0, fmt.Errorf("box %q: no QEMU process", name)
	}
	f, err := OpenNoFollow(MemoryFile(dir), os.O_RDONLY)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	holes, ok, err := overlay.UnwrittenRanges(f)
	if err != nil {
		return 0, fmt.Errorf("box %q: the extents of its RAM file: %w", name, err)
	}
	if !ok {
		return 0, fmt.Errorf("box %q: the filesystem of its RAM file has no extent map (FIEMAP)", name)
	}
	start, err := mappingOf(pid, MemoryFile(dir))
	if err != nil {
		return 0, err
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0, fmt.Errorf("box %q: pidfd_open: %w", name, err)
	}
	defer unix.Close(pidfd)
	// Addresses in QEMU's memory, never dereferenced here: struct iovecs
	// of plain integers. The kernel advises at most UIO_MAXIOV ranges and
	// about 2 GiB a call, and says how much it did.
	type iovec struct{ base, len uint64 }
	iov := make([]iovec, len(holes))
	for i, h := range holes {
		iov[i] = iovec{start + uint64(h.Off), uint64(h.Len)}
	}
	var done int64
	for len(iov) > 0 {
		batch := iov[:min(len(iov), 1024)]
		n, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(pidfd), uintptr(unsafe.Pointer(&batch[0])), uintptr(len(batch)), unix.MADV_PAGEOUT, 0, 0)
		if errno != 0 {
			return done, fmt.Errorf("box %q: process_madvise: %w", name, errno)
		}
		if n == 0 {
			break
		}
		done += int64(n)
		for left := uint64(n); left > 0 && len(iov) > 0; {
			if iov[0].len <= left {
				left -= iov[0].len
				iov = iov[1:]
				continue
			}
			iov[0].base += left
			iov[0].len -= left
			left = 0
		}
	}
	for _, h := range holes {
		if err := unix.Fadvise(int(f.Fd()), h.Off, h.Len, unix.FADV_DONTNEED); err != nil {
			return done, fmt.Errorf("box %q: fadvise: %w", name, err)
		}
	}
	return done, nil
}

// mappingOf is the address where process pid maps file from offset 0.
func mappingOf(pid int, file string) (uint64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// start-end perms offset dev inode path
		fs := strings.Fields(sc.Text())
		if len(fs) < 6 || fs[5] != file || strings.Trim(fs[2], "0") != "" {
			continue
		}
		addr, _, _ := strings.Cut(fs[0], "-")
		return strconv.ParseUint(addr, 16, 64)
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("QEMU (pid %d) does not map %s", pid, file)
}

// ReserveRAM gives a box's RAM file (MemoryFile(dir)) all its disk blocks
// before QEMU maps it, so that the guest touching a page never needs a block
// the filesystem no longer has. QEMU maps the file shared; a page fault in a
// hole of it allocates a block, and on a full filesystem (another box's disk
// grew, a snapshot was written) the kernel answers with SIGBUS: QEMU dies
// and the box with it. fallocate reserves the blocks as unwritten extents:
// they read as zeros, cost no I/O and no page cache, and SEEK_DATA still
// sees the pages the guest never touched as holes, so snapshots stay
// sparse. A filesystem without room for the whole RAM fails the start with
// ENOSPC instead of killing the box later. Data already in the file (a box
// suspended with its RAM there) is kept.
//
// The folder is QEMU's: the file is opened without following a link and
// must be a plain file with one name, owned by root or QEMU, or is refused.
func (h *Host) ReserveRAM(dir string, size int64) error {
	path := MemoryFile(dir)
	f, err := OpenNoFollow(path, os.O_RDWR|os.O_CREATE)
	if err != nil {
		return fmt.Errorf("reserve RAM: %w", err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("reserve RAM: %w", err)
	}
	if st.Uid != 0 && int(st.Uid) != h.QEMUUID() {
		return fmt.Errorf("reserve RAM: %s belongs to neither root nor QEMU (a file planted in the box folder?)", path)
	}
	if st.Uid == 0 {
		// Made now: QEMU's group writes it, nobody else reads it.
		if err := f.Chown(0, h.QEMUGID()); err != nil {
			return fmt.Errorf("reserve RAM: %w", err)
		}
		if err := f.Chmod(0o660); err != nil {
			return fmt.Errorf("reserve RAM: %w", err)
		}
	}
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		if st.Size == 0 {
			f.Truncate(0) // give back what was reserved of it
		}
		if errors.Is(err, unix.EOPNOTSUPP) {
			return nil // a filesystem without fallocate: the file stays sparse
		}
		var sfs unix.Statfs_t
		free := "?"
		if unix.Fstatfs(int(f.Fd()), &sfs) == nil {
			free = FormatSize(int64(sfs.Bavail) * sfs.Bsize)
		}
		return fmt.Errorf("the box's RAM needs %s of disk under %s (%s free): %w", FormatSize(size), filepath.Dir(dir), free, err)
	}
	return nil
}
