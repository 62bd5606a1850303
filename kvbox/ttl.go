package kvbox

import (
	"context"
	"errors"
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
	b, err := h.d.SetExpires(ctx, name, at, func(b domain.Box) error {
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
