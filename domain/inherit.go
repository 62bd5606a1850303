package domain

import (
	"errors"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// CloseInheritedOnExec marks every file descriptor above standard error
// close-on-exec. Whatever started kvbox may have left descriptors open
// (a lock held with flock(1), a CI runner's pipe); without this, the
// reapers and port holders kvbox starts detached would hold them for
// hours: the lock never freed, the pipe never at its end. The descriptors
// kvbox hands a child on purpose (ExtraFiles) are set up in the child
// afresh and are not affected. Call it first in main.
func CloseInheritedOnExec() error {
	err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
		return os.NewSyscallError("close_range", err)
	}
	// Kernels before 5.11: one by one.
	ents, rerr := os.ReadDir("/proc/self/fd")
	if rerr != nil {
		return rerr
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd > 2 {
			unix.CloseOnExec(fd)
		}
	}
	return nil
}
