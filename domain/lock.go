package domain

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// Lock takes kvbox's host-wide lock, which serializes every change of
// which boxes exist and which addresses they hold: two `kvbox new` run at
// the same moment from two shells never pick the same address.
func (h *Host) Lock() (unlock func(), err error) {
	l, err := h.waitLock(filepath.Join(h.StateDir, "lock"))
	if err != nil {
		return nil, err
	}
	return l.Unlock, nil
}

// lockBox takes the lock of one box, held by commands that change it.
func (h *Host) lockBox(name string) (*FileLock, error) {
	return h.waitLock(filepath.Join(h.StateDir, "locks", name+".lock"))
}

// ErrInterrupted is returned by a lock wait that h.Interrupt ended.
var ErrInterrupted = errors.New("interrupted while waiting for a lock another kvbox holds")

// waitLock takes the lock at path, waiting for its holder; without
// h.Interrupt it blocks in flock, with it it polls so that the wait can end.
func (h *Host) waitLock(path string) (*FileLock, error) {
	if h.Interrupt == nil {
		return LockFile(path, true)
	}
	for {
		l, err := LockFile(path, false)
		if !errors.Is(err, ErrLocked) {
			return l, err
		}
		select {
		case <-h.Interrupt:
			return nil, fmt.Errorf("%w (%s)", ErrInterrupted, path)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// FileLock is an exclusive flock on a lock file.
type FileLock struct {
	f    *os.File
	path string
}

// ErrLocked is returned by LockFile without wait when another holds the lock.
var ErrLocked = errors.New("locked by another kvbox")

// LockFile locks path, creating it; without wait it fails with ErrLocked
// instead of waiting. Once locked, it checks that path still names the file
// it locked: a holder may remove the lock file on release (RemoveAndUnlock),
// and a kvbox that opened it just before must then try again rather than
// hold a lock on a file nobody else can see.
func LockFile(path string, wait bool) (*FileLock, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	how := syscall.LOCK_EX
	if !wait {
		how |= syscall.LOCK_NB
	}
	for {
		// 0600: a local user who could open the lock could also flock it
		// and block every kvbox command.
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, err
		}
		if err := f.Chmod(0o600); err != nil { // one an older kvbox made 0644
			f.Close()
			return nil, err
		}
		if err := syscall.Flock(int(f.Fd()), how); err != nil {
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				return nil, ErrLocked
			}
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		var held, now syscall.Stat_t
		if syscall.Fstat(int(f.Fd()), &held) == nil && syscall.Stat(path, &now) == nil && held.Ino == now.Ino && held.Dev == now.Dev {
			return &FileLock{f: f, path: path}, nil
		}
		f.Close()
	}
}

// createLocked makes a new lock file at path that is locked from the first
// moment anyone can see it: it is made and locked under another name, then
// renamed into place. (LockFile creates, then locks: another kvbox that
// locks it in between would take the file for one a dead kvbox left.)
func createLocked(path string) (*FileLock, error) {
	tmp := path + ".new"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("lock %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		f.Close()
		os.Remove(tmp)
		return nil, err
	}
	return &FileLock{f: f, path: path}, nil
}

// lockExisting locks the lock file at path without waiting and without
// creating it: it fails when there is no such file, when another kvbox
// holds it (ErrLocked), or when the file was removed while it was being
// locked (its holder finished).
func lockExisting(path string) (*FileLock, error) {
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, ErrLocked
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	var held, now syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &held) != nil || syscall.Stat(path, &now) != nil || held.Ino != now.Ino || held.Dev != now.Dev {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, os.ErrNotExist)
	}
	return &FileLock{f: f, path: path}, nil
}

// Unlock releases the lock and keeps the lock file.
func (l *FileLock) Unlock() { l.f.Close() }

// RemoveAndUnlock deletes the lock file (what it guarded is gone) and
// releases the lock.
func (l *FileLock) RemoveAndUnlock() {
	os.Remove(l.path)
	l.f.Close()
}
