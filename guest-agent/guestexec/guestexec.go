// Package guestexec holds what every part of the guest agent that starts a
// command needs: who runs it (a user of the guest's /etc/passwd), where
// (a working directory) and on what (a pseudo-terminal). The agent's own
// exec and the envd feature share it.
package guestexec

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultPath is the PATH of a command whose caller sets none.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// LookPath finds name in path (a PATH value; DefaultPath when empty), the
// command's PATH rather than the agent's. A name with a slash is returned
// as it is.
func LookPath(name, path string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	if path == "" {
		path = DefaultPath
	}
	for _, dir := range strings.Split(path, ":") {
		if dir == "" {
			dir = "."
		}
		p := dir + "/" + name
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%q: executable file not found in PATH", name)
}

// User is who a command runs as.
type User struct {
	Name     string
	UID, GID uint32
	Groups   []uint32
	Home     string
}

// LookupUser resolves a user name or numeric uid through the guest's
// /etc/passwd and /etc/group (os/user's pure-Go path: the agent is static).
// A numeric uid with no passwd entry runs with gid 0 and HOME /, as
// docker's --user does.
func LookupUser(s string) (*User, error) {
	u, err := user.Lookup(s)
	if err != nil {
		if _, numeric := strconv.ParseUint(s, 10, 32); numeric == nil {
			u, err = user.LookupId(s)
			if err != nil {
				id, _ := strconv.ParseUint(s, 10, 32)
				return &User{Name: s, UID: uint32(id), Home: "/"}, nil
			}
		} else {
			var unk user.UnknownUserError
			if errors.As(err, &unk) {
				return nil, fmt.Errorf("user %s: no such user in the box (/etc/passwd)", s)
			}
			return nil, fmt.Errorf("user %s: %w", s, err)
		}
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("user %s: bad uid/gid %q/%q in /etc/passwd", s, u.Uid, u.Gid)
	}
	g := &User{Name: u.Username, UID: uint32(uid), GID: uint32(gid), Home: u.HomeDir}
	if g.Home == "" {
		g.Home = "/"
	}
	if ids, err := u.GroupIds(); err == nil {
		for _, id := range ids {
			if n, err := strconv.ParseUint(id, 10, 32); err == nil {
				g.Groups = append(g.Groups, uint32(n))
			}
		}
	}
	if len(g.Groups) == 0 {
		g.Groups = []uint32{g.GID}
	}
	return g, nil
}

// CheckWorkdir says in one line why dir cannot be a working directory.
func CheckWorkdir(dir string) error {
	st, err := os.Stat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("workdir %s: no such directory in the box", dir)
	case err != nil:
		return fmt.Errorf("workdir %s: %w", dir, errors.Unwrap(err))
	case !st.IsDir():
		return fmt.Errorf("workdir %s: not a directory", dir)
	}
	return nil
}

// OpenPTY allocates a pty pair. devpts must be mounted on /dev/pts (the
// guest's init does that).
func OpenPTY() (master, slave *os.File, err error) {
	fd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open /dev/ptmx: %w", err)
	}
	// The master is non-blocking so the runtime poller can interrupt
	// reads (deadlines, Close).
	master = os.NewFile(uintptr(fd), "/dev/ptmx")
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		master.Close()
		return nil, nil, fmt.Errorf("unlock pty: %w", err)
	}
	n, err := unix.IoctlGetInt(fd, unix.TIOCGPTN)
	if err != nil {
		master.Close()
		return nil, nil, fmt.Errorf("pty number: %w", err)
	}
	name := fmt.Sprintf("/dev/pts/%d", n)
	sfd, err := unix.Open(name, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		master.Close()
		return nil, nil, fmt.Errorf("open %s: %w", name, err)
	}
	return master, os.NewFile(uintptr(sfd), name), nil
}

// SetWinsize sets the terminal size of a pty (either end); a zero size is
// left alone.
func SetWinsize(f *os.File, rows, cols uint16) error {
	if rows == 0 || cols == 0 {
		return nil
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols})
	}); err != nil {
		return err
	}
	return serr
}

// Drain bounds how long a process's output is read once it has exited:
// until DrainIdle passes with no new output, and DrainMax at the most, so a
// background child that keeps the output open, even writing, holds the
// process's end back no longer. The zero Drain is of a running process.
type Drain struct{ at atomic.Int64 }

const (
	// DrainIdle is how long the output is read after the exit with no
	// new data.
	DrainIdle = 250 * time.Millisecond
	// DrainMax is how long the output is read after the exit at most.
	DrainMax = 2 * time.Second
)

// Exited records that the process has exited and been reaped.
func (d *Drain) Exited() { d.at.Store(time.Now().UnixNano()) }

// Done reports whether the process has exited.
func (d *Drain) Done() bool { return d.at.Load() != 0 }

// Deadline is the read deadline of the output's next read after the exit.
func (d *Drain) Deadline() time.Time {
	next := time.Now().Add(DrainIdle)
	if end := time.Unix(0, d.at.Load()).Add(DrainMax); next.After(end) {
		return end
	}
	return next
}

// Pump reads the output f in chunks of up to size bytes, each handed to
// out, until it ends (EOF for a pipe, EIO for a pty whose other side is
// closed), its read deadline passes once the process has exited, or out
// returns false. out may not keep the chunk: its buffer is read into
// again.
func (d *Drain) Pump(f *os.File, size int, out func([]byte) bool) {
	buf := make([]byte, size)
	for {
		if d.Done() {
			f.SetReadDeadline(d.Deadline())
		}
		n, err := f.Read(buf)
		if n > 0 && !out(buf[:n]) {
			return
		}
		if err != nil {
			return
		}
	}
}
