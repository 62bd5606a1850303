package kvbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
)

// RunReaper is the reaper of box or snapshot KIND NAME whose identity is
// id (a box's UUID, a snapshot's creation time): it sleeps until the
// deadline and removes it then, through Remove (a box whose deadline
// suspends it is suspended), unless it was removed,
// given another identity or no deadline meanwhile. It writes what it does
// on log, and returns when that is done or ctx ends; a second reaper of the
// same thing returns at once. h is best opened with Config.NoSweep.
func RunReaper(ctx context.Context, h *Host, kind, name, id string, log io.Writer) error {
	if kind != ReapBox && kind != ReapSnapshot {
		return base.Errorf(base.Invalid, "reaper kind %q", kind)
	}
	logf := func(format string, v ...any) {
		fmt.Fprintf(log, "%s reaper[%d] %s %s: %s\n", time.Now().UTC().Format(time.RFC3339), os.Getpid(), kind, name, fmt.Sprintf(format, v...))
	}
	held, err := base.Lock(h.layout.ReaperLock(kind, name), false)
	if errors.Is(err, base.ErrLocked) {
		return nil // another reaper has it
	}
	if err != nil {
		logf("%v", err)
		return err
	}
	defer held.Release()
	held.Note(strconv.Itoa(os.Getpid()) + "\n")
	logf("started")
	for {
		// The deadline is read anew on every wake (kvbox ttl only
		// rewrites it), on a connection made again if libvirtd dropped
		// the one that slept (Host.Conn).
		at, gone, err := h.deadline(kind, name, id)
		if err != nil {
			logf("reading the deadline: %v (trying again in 10s)", err)
			if !sleep(ctx, 10*time.Second) {
				return nil
			}
			continue
		}
		if gone || at == nil {
			logf("nothing to do (gone, or no deadline any more)")
			return nil
		}
		left := time.Until(*at)
		if left <= 0 {
			return h.reap(ctx, kind, name, id, logf)
		}
		if !sleep(ctx, min(left, ReaperRecheck)) {
			return nil
		}
	}
}

// sleep waits d; false when ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}

// deadline reads the deadline of the box or snapshot a reaper waits for;
// gone says it is not there any more (or a new one has its name).
func (h *Host) deadline(kind, name, id string) (at *time.Time, gone bool, err error) {
	if kind == ReapBox {
		b, err := h.d.Get(name)
		if errors.Is(err, base.ErrNotFound) {
			return nil, true, nil
		}
		if err != nil {
			return nil, false, err
		}
		return b.Expires, b.UUID != id, nil
	}
	s, err := h.snaps.Get(name)
	if errors.Is(err, base.ErrNotFound) {
		return nil, true, nil
	}
	if err != nil {
		return nil, false, err
	}
	return s.Expires, snapshotID(s) != id, nil
}

// reap removes the box or snapshot whose deadline passed: the one id
// names, checked again under its lock.
func (h *Host) reap(ctx context.Context, kind, name, id string, logf func(string, ...any)) error {
	if kind == ReapSnapshot {
		removed, clones, err := h.reapSnapshotIfDue(ctx, name, id)
		switch {
		case err != nil:
			logf("removing the expired snapshot: %v", err)
			return err
		case removed:
			logf("removed: its TTL ended")
		case len(clones) > 0:
			logf("expired, kept until its clones are gone (%s): the last one's removal removes it", strings.Join(clones, ", "))
		default:
			logf("nothing to do (gone, made again under its name, or its deadline moved)")
		}
		return nil
	}
	if b, err := h.d.Get(name); err == nil && b.OnExpiry == domain.ExpirySuspend {
		return reaped(logf, h.suspendDue(ctx, name, id), "suspended", "suspending", "suspended: its TTL ended (it has no deadline while suspended)")
	}
	return reaped(logf, h.removeIf(ctx, name, true, dueBox(id)), "removed", "removing", "removed: its TTL ended")
}

// reaped logs what became of an expired box: done, gone, not due (nothing
// was done: what in the past tense), or failed (doing: what failed).
func reaped(logf func(string, ...any), err error, what, doing, done string) error {
	switch {
	case errors.Is(err, base.ErrNotFound):
		logf("nothing to do (gone)")
	case errors.Is(err, base.ErrNotDue):
		logf("nothing %s: %v", what, err)
	case err != nil:
		logf("%s the expired box: %v", doing, err)
		return err
	default:
		logf("%s", done)
	}
	return nil
}
