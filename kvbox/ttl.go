package kvbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/suspend"
)

// A box (or snapshot) with a deadline has a reaper: a small detached
// process (Config.ReaperCommand runs RunReaper; the CLI's is `kvbox __reap
// KIND NAME ID`, its own session, no terminal) that sleeps until the
// deadline, reads the deadline again from where it lives (the box's libvirt
// metadata, the snapshot's snapshot.json) and removes the box through
// Remove once it has passed (or suspends it, if its deadline suspends it:
// domain.ExpirySuspend, which a clone gets from its request). It wakes at least every ReaperRecheck to read
// the deadline again, so a deadline changed behind its back is honoured
// within that time; SetExpires restarts it anyway. No daemon and no timer
// is needed, and nothing runs for a box without a deadline. A host reboot
// ends every reaper: the next Open removes what expired meanwhile and
// starts the reapers of the rest (Sweep).
//
// Each reaper holds an flock on reapers/KIND-NAME.lock (its pid inside)
// while it lives: a second reaper of the same thing exits at once, and
// kvbox tells whether one is alive without trusting a pid.

// Reaper kinds.
const (
	ReapBox      = "box"
	ReapSnapshot = "snapshot"
)

// ReaperArg is the word that comes before KIND NAME ID on a reaper's
// command line (the CLI's hidden command): StopReaper signals only a
// process whose command line has them.
const ReaperArg = "__reap"

// ReaperRecheck is the longest a reaper sleeps before reading its deadline
// again.
const ReaperRecheck = 30 * time.Second

// SetExpires gives box name a deadline (nil: none) and restarts its
// reaper; it returns the box as it is now.
func (h *Host) SetExpires(ctx context.Context, name string, at *time.Time) (Box, error) {
	b, err := h.d.SetExpires(name, at, func(b domain.Box) error {
		h.stopReaper(ReapBox, name)
		if b.Expires == nil {
			return nil
		}
		return h.startReaper(ReapBox, name, b.UUID)
	})
	if err != nil {
		return Box{}, err
	}
	return h.box(b), nil
}

// SetSnapshotExpires gives snapshot name a deadline (nil: none) and
// restarts its reaper. A snapshot boxes are cloned from is kept past its
// deadline until the last of them is removed.
func (h *Host) SetSnapshotExpires(ctx context.Context, name string, at *time.Time) (snapshot.Snapshot, error) {
	s, err := snapshot.SetExpires(h.d, h.snaps, name, at)
	if err != nil {
		return snapshot.Snapshot{}, err
	}
	h.stopReaper(ReapSnapshot, name)
	if s.Expires == nil {
		return s, nil
	}
	return s, h.startReaper(ReapSnapshot, name, snapshotID(s))
}

// suspendDue suspends box name, whose deadline suspends it
// (domain.ExpirySuspend), if under its lock it is still the box with UUID
// uuid and its deadline has passed; the suspend takes the deadline away.
func (h *Host) suspendDue(ctx context.Context, name, uuid string) error {
	_, err := suspend.SuspendWith(ctx, h.d, name, suspend.SuspendOptions{Check: dueBox(uuid), ClearExpires: true})
	return err
}

// snapshotID tells a snapshot from a later one of the same name.
func snapshotID(s snapshot.Snapshot) string { return s.Created.UTC().Format(time.RFC3339Nano) }

// dueBox is removeIf's check for a TTL: the box is the one with uuid (its
// libvirt UUID, which a new box of the same name does not have) and its
// deadline has passed.
func dueBox(uuid string) func(domain.Box) error {
	return func(b domain.Box) error {
		if uuid == "" || b.UUID != uuid {
			return base.Errorf(base.NotDue, "box %q is another box now (UUID %s, not %s)", b.Name, b.UUID, uuid)
		}
		if b.Expires == nil || time.Now().Before(*b.Expires) {
			return base.Errorf(base.NotDue, "box %q has no past deadline any more", b.Name)
		}
		return nil
	}
}

// dueSnapshot is snapshot.RemoveIf's check for a TTL: the snapshot is the
// one id names ("": any) and its deadline has passed.
func dueSnapshot(id string) func(snapshot.Snapshot) error {
	return func(s snapshot.Snapshot) error {
		if id != "" && snapshotID(s) != id {
			return base.Errorf(base.NotDue, "snapshot %q is another snapshot now (made %s, not %s)", s.Name, snapshotID(s), id)
		}
		if s.Expires == nil || time.Now().Before(*s.Expires) {
			return base.Errorf(base.NotDue, "snapshot %q has no past deadline any more", s.Name)
		}
		return nil
	}
}

// Sweep removes the boxes and snapshots whose deadline has passed (under
// their locks, through Remove; a running box whose deadline suspends it is
// suspended), and starts the reaper of every other
// deadline that has none. Open does it (after a reboot no reaper runs); a
// front without reapers calls it now and then.
func (h *Host) Sweep(ctx context.Context) {
	boxes, err := h.d.Boxes()
	if err != nil {
		h.notify(true, "looking for expired boxes: %v", err)
		return
	}
	for _, b := range boxes {
		if b.Expires == nil {
			continue
		}
		if time.Now().Before(*b.Expires) {
			if !h.reaperAlive(ReapBox, b.Name) {
				h.startReaper(ReapBox, b.Name, b.UUID)
			}
			continue
		}
		if b.OnExpiry == domain.ExpirySuspend {
			if b.State != domain.StateRunning {
				continue // its reaper, or Resume, deals with it
			}
			err := h.suspendDue(ctx, b.Name, b.UUID)
			switch {
			case err == nil:
				h.notify(false, "suspended box %s, whose TTL ended at %s", b.Name, b.Expires.Format(time.RFC3339))
			case !errors.Is(err, base.ErrNotFound) && !errors.Is(err, base.ErrNotDue):
				h.notify(true, "suspending expired box %s: %v", b.Name, err)
			}
			continue
		}
		step.KillPoint("sweep-expired-box")
		// By identity: a box removed meanwhile may have a successor of
		// the same name, which this deadline is not.
		err := h.removeIf(ctx, b.Name, true, dueBox(b.UUID))
		switch {
		case err == nil:
			h.notify(false, "removed box %s, whose TTL ended at %s", b.Name, b.Expires.Format(time.RFC3339))
		case !errors.Is(err, base.ErrNotFound) && !errors.Is(err, base.ErrNotDue):
			h.notify(true, "removing expired box %s: %v", b.Name, err)
		}
	}
	h.sweepSnapshots(ctx)
}

func (h *Host) sweepSnapshots(ctx context.Context) {
	snaps, _ := h.snaps.List()
	for _, s := range snaps {
		if s.Expires == nil {
			continue
		}
		if time.Now().Before(*s.Expires) {
			if !h.reaperAlive(ReapSnapshot, s.Name) {
				h.startReaper(ReapSnapshot, s.Name, snapshotID(s))
			}
			continue
		}
		if removed, _, err := h.reapSnapshotIfDue(ctx, s.Name, snapshotID(s)); removed {
			h.notify(false, "removed snapshot %s, whose TTL ended at %s", s.Name, s.Expires.Format(time.RFC3339))
		} else if err != nil {
			h.notify(true, "removing expired snapshot %s: %v", s.Name, err)
		}
	}
}

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
	// A box's folder is writable by QEMU: never follow a link planted
	// there, and never block on a FIFO.
	log, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o600)
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
