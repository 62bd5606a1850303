package kvbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"kvbox.dev/kvbox/base"
)

// The reaper processes: started detached with Config.ReaperCommand, told
// apart by their lock and their command line, stopped by signal.

// reaperLog is where the reaper of KIND NAME writes what it did: a box's
// goes with the box, in its folder; a snapshot's is in logs/.
func (h *Host) reaperLog(kind, name string) string {
	if kind == ReapBox {
		return h.layout.BoxReaperLog(name)
	}
	return h.layout.SnapshotReaperLog(name)
}

// reaperAlive reports whether a reaper of KIND NAME runs.
func (h *Host) reaperAlive(kind, name string) bool {
	l, err := base.LockExisting(h.layout.ReaperLock(kind, name))
	if errors.Is(err, base.ErrLocked) {
		return true
	}
	if err == nil {
		l.Unlock()
	}
	return false
}

// startReaper starts the reaper of KIND NAME (id tells this box or
// snapshot from a later one of the same name: a box's UUID, a snapshot's
// creation time). It returns at once; the reaper runs detached, in its own
// session, logging to reaperLog. Without Config.ReaperCommand nothing is
// started.
func (h *Host) startReaper(kind, name, id string) error {
	if h.cfg.ReaperCommand == nil {
		return nil
	}
	cmd := h.cfg.ReaperCommand(kind, name, id)
	logPath := h.reaperLog(kind, name)
	if err := os.MkdirAll(filepath.Dir(logPath), 0o750); err != nil {
		return err
	}
	// Never follow a link, never block on a FIFO; a log that grew past
	// maxReaperLog (a name used again and again) starts over.
	flags := os.O_WRONLY | os.O_CREATE | os.O_APPEND | syscall.O_NOFOLLOW | syscall.O_NONBLOCK
	if fi, err := os.Lstat(logPath); err == nil && fi.Size() > maxReaperLog {
		flags |= os.O_TRUNC
	}
	log, err := os.OpenFile(logPath, flags, 0o600)
	if err != nil {
		return fmt.Errorf("reaper log of %s %q: %w", kind, name, err)
	}
	defer log.Close()
	if fi, err := log.Stat(); err != nil || !fi.Mode().IsRegular() {
		return fmt.Errorf("reaper log %s is not a regular file", logPath)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the reaper of %s %q: %w", kind, name, err)
	}
	// Reaped when it ends, so that a long-running front (kvbox serve, a
	// reaper per sandbox) keeps no zombie; a CLI that exits first leaves
	// it to init.
	go cmd.Wait()
	return nil
}

// maxReaperLog bounds a reaper log: past it, the next reaper of that name
// starts it over.
const maxReaperLog = 1 << 20

// stopReaper ends the reaper of KIND NAME, if one runs (and is not the
// calling process), and waits until it is gone.
func (h *Host) stopReaper(kind, name string) {
	path := h.layout.ReaperLock(kind, name)
	for range 100 {
		if !h.reaperAlive(kind, name) {
			if l, err := base.LockExisting(path); err == nil {
				l.RemoveAndUnlock() // a dead reaper's file
			}
			return
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 1 {
			time.Sleep(10 * time.Millisecond) // it is writing its pid
			continue
		}
		if pid == os.Getpid() {
			return // the reaper itself is removing its box
		}
		if isReaper(pid, kind, name) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// isReaper checks that pid is a reaper of KIND NAME, so a stale or
// rewritten pid never gets a signal meant for a reaper.
func isReaper(pid int, kind, name string) bool {
	args := cmdline(pid)
	for i := range args {
		if args[i] == ReaperArg && i+2 < len(args) && args[i+1] == kind && args[i+2] == name {
			return true
		}
	}
	return false
}

// cmdline is the command line of process pid (nil when it is gone).
func cmdline(pid int) []string {
	if pid <= 0 {
		return nil
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return nil
	}
	return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
}
