package base

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// FileLock is an exclusive flock on a lock file: the one way kvbox holds
// a lock across processes (the host lock, a box's, a snapshot name's, a
// reaper's, a pull's, an image build's, a bridge's rules).
type FileLock struct {
	f    *os.File
	path string
}

// ErrLocked is returned by a lock taken without waiting when another holds it.
var ErrLocked = errors.New("locked by another kvbox")

// Lock locks path, creating it (and its folder); without wait it fails
// with ErrLocked instead of waiting. Once locked, it checks that path still
// names the file it locked: a holder may remove the lock file on release
// (RemoveAndUnlock), and a kvbox that opened it just before must then try
// again rather than hold a lock on a file nobody else can see.
func Lock(path string, wait bool) (*FileLock, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	for {
		// 0600: a local user who could open the lock could also flock it
		// and block every kvbox command.
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, err
		}
		if err := f.Chmod(0o600); err != nil {
			f.Close()
			return nil, err
		}
		l, err := take(f, path, wait)
		if err != nil || l != nil {
			return l, err
		}
	}
}

// Wait takes the lock at path, waiting for its holder. With stop, the wait
// polls and ends with an Interrupted error once stop is closed; waiting, if
// set, is called once when the lock is found held (to say so).
func Wait(path string, stop <-chan struct{}, waiting func()) (*FileLock, error) {
	if stop == nil && waiting == nil {
		return Lock(path, true)
	}
	for {
		l, err := Lock(path, false)
		if !errors.Is(err, ErrLocked) {
			return l, err
		}
		if waiting != nil {
			waiting()
			waiting = nil
		}
		select {
		case <-stop:
			return nil, Errorf(Interrupted, "interrupted while waiting for a lock another kvbox holds (%s)", path)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// CreateLocked makes a new lock file at path that is locked from the first
// moment anyone can see it: it is made and locked under another name, then
// renamed into place. (Lock creates, then locks: another kvbox that locks
// it in between would take the file for one a dead kvbox left.)
func CreateLocked(path string) (*FileLock, error) {
	tmp := path + ".new"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	if err := flock(f, tmp, false); err != nil {
		f.Close()
		os.Remove(tmp)
		return nil, err
	}
	if err := os.Rename(tmp, path); err != nil {
		f.Close()
		os.Remove(tmp)
		return nil, err
	}
	return &FileLock{f: f, path: path}, nil
}

// LockExisting locks the lock file at path without waiting and without
// creating it: it fails when there is no such file, when another kvbox
// holds it (ErrLocked), or when the file was removed while it was being
// locked (its holder finished).
func LockExisting(path string) (*FileLock, error) {
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	l, err := take(f, path, false)
	if err == nil && l == nil {
		err = fmt.Errorf("lock %s: %w", path, os.ErrNotExist)
	}
	return l, err
}

// take flocks f, open on path, and checks that path still names it: nil,
// nil (and f closed) when it does not any more.
func take(f *os.File, path string, wait bool) (*FileLock, error) {
	if err := flock(f, path, wait); err != nil {
		f.Close()
		return nil, err
	}
	l := &FileLock{f: f, path: path}
	if !l.current() {
		f.Close()
		return nil, nil
	}
	return l, nil
}

// flock is the one call of flock(2): an exclusive lock, ErrLocked when
// another holds it and wait is false.
func flock(f *os.File, path string, wait bool) error {
	how := syscall.LOCK_EX
	if !wait {
		how |= syscall.LOCK_NB
	}
	if err := syscall.Flock(int(f.Fd()), how); err != nil {
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return ErrLocked
		}
		return fmt.Errorf("lock %s: %w", path, err)
	}
	return nil
}

// current reports whether the lock's path still names the file it holds.
func (l *FileLock) current() bool {
	var held, now syscall.Stat_t
	return syscall.Fstat(int(l.f.Fd()), &held) == nil && syscall.Stat(l.path, &now) == nil && held.Ino == now.Ino && held.Dev == now.Dev
}

// Note replaces what the lock file holds with s (a reaper's pid).
func (l *FileLock) Note(s string) error {
	if err := l.f.Truncate(0); err != nil {
		return err
	}
	_, err := l.f.WriteAt([]byte(s), 0)
	return err
}

// Unlock releases the lock and keeps the lock file.
func (l *FileLock) Unlock() { l.f.Close() }

// RemoveAndUnlock deletes the lock file (what it guarded is gone) and
// releases the lock.
func (l *FileLock) RemoveAndUnlock() {
	os.Remove(l.path)
	l.f.Close()
}

// Release deletes the lock file if it is still this lock's (nobody removed
// and made it again meanwhile), and releases the lock.
func (l *FileLock) Release() {
	if l.current() {
		os.Remove(l.path)
	}
	l.f.Close()
}
