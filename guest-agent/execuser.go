package agent

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"time"
)

// guestUser is who an exec with ExecRequest.User runs as.
type guestUser struct {
	name     string
	uid, gid uint32
	groups   []uint32
	home     string
}

// lookupUser resolves a user name or numeric uid through the guest's
// /etc/passwd and /etc/group (os/user's pure-Go path: the agent is static).
// A numeric uid with no passwd entry runs with gid 0 and HOME /, as
// docker's --user does.
func lookupUser(s string) (*guestUser, error) {
	u, err := user.Lookup(s)
	if err != nil {
		if _, numeric := strconv.ParseUint(s, 10, 32); numeric == nil {
			u, err = user.LookupId(s)
			if err != nil {
				id, _ := strconv.ParseUint(s, 10, 32)
				return &guestUser{name: s, uid: uint32(id), home: "/"}, nil
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
	g := &guestUser{name: u.Username, uid: uint32(uid), gid: uint32(gid), home: u.HomeDir}
	if g.home == "" {
		g.home = "/"
	}
	if ids, err := u.GroupIds(); err == nil {
		for _, id := range ids {
			if n, err := strconv.ParseUint(id, 10, 32); err == nil {
				g.groups = append(g.groups, uint32(n))
			}
		}
	}
	if len(g.groups) == 0 {
		g.groups = []uint32{g.gid}
	}
	return g, nil
}

// checkWorkdir says in one line why dir cannot be a working directory.
func checkWorkdir(dir string) error {
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

// killGrace is how long Exec waits for the exit after killing a command
// whose timeout passed.
const killGrace = 10 * time.Second

// TimeoutError is Exec's error when ExecRequest.Timeout passed: the
// command's process group was killed (SIGKILL) and has exited.
type TimeoutError struct{ After time.Duration }

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("timed out after %s: the command's process group was killed", e.After)
}
