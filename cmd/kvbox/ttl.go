package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/suspend"
)

// parseTTL reads a --ttl or `kvbox ttl` duration: a Go duration (30s, 30m,
// 2h, 1h30m) or a number of days (3d); none clears it (ok false).
func parseTTL(s string) (d time.Duration, ok bool, err error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "none", "never", "off":
		return 0, false, nil
	}
	if n, found := strings.CutSuffix(s, "d"); found {
		var days int
		if _, err := fmt.Sscanf(n, "%d", &days); err == nil && fmt.Sprint(days) == n && days > 0 {
			return time.Duration(days) * 24 * time.Hour, true, nil
		}
	}
	d, err = time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, false, fmt.Errorf("%w: TTL %q: give a positive duration like 20s, 30m, 2h or 3d, or none", errUsage, s)
	}
	if d < time.Second {
		return 0, false, fmt.Errorf("%w: TTL %q: give at least 1s", errUsage, s)
	}
	return d, true, nil
}

// ttlLeft is the TTL column: the time left, "expired", or "-".
func ttlLeft(at *time.Time) string {
	if at == nil {
		return "-"
	}
	d := time.Until(*at)
	switch {
	case d <= 0:
		return "expired"
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()+0.5))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

func (a *app) newCmdTTL() *cobra.Command {
	return &cobra.Command{
		Use:   "ttl BOX DURATION|none",
		Short: "Set when a box removes itself (time from now), or clear it",
		Long: `Set a box's deadline to DURATION from now (20s, 30m, 2h, 3d), replacing any
earlier one, or clear it with none. At its deadline the box is removed like
kvbox rm --force would (a small detached kvbox process waits for it; no
daemon is needed), within a minute even if no kvbox command runs. The
deadline is kept in the box's libvirt metadata (virsh dumpxml shows
<expires>); kvbox ls shows the time left.`,
		Example: "  kvbox ttl job-17 2h\n  kvbox ttl job-17 none",
		Args:    exactArgs(2, "a box name and a duration (or none)"),
		RunE: func(c *cobra.Command, args []string) error {
			d, ok, err := parseTTL(args[1])
			if err != nil {
				return err
			}
			h, err := a.Host()
			if err != nil {
				return err
			}
			var at *time.Time
			if ok {
				t := time.Now().Add(d)
				at = &t
			}
			b, err := h.SetExpires(args[0], at)
			if err != nil {
				return err
			}
			if b.Expires == nil {
				fmt.Fprintf(a.io.Out, "✓ box %s has no TTL: it stays until kvbox rm %s\n", b.Name, b.Name)
			} else {
				fmt.Fprintf(a.io.Out, "✓ box %s is removed at %s (in %s)\n", b.Name, b.Expires.Format(time.RFC3339), ttlLeft(b.Expires))
			}
			return nil
		},
	}
}

// setBoxTTL gives a box just created its deadline; a box whose deadline
// cannot be set is removed (it would never expire).
func (a *app) setBoxTTL(ctx context.Context, h *domain.Host, name string, at time.Time) (domain.Box, error) {
	b, err := h.SetExpires(name, &at)
	if err != nil {
		h.Remove(context.WithoutCancel(ctx), name, true)
		return domain.Box{}, fmt.Errorf("box %q could not get its TTL, so it is removed: %w", name, err)
	}
	return b, nil
}

// removeBox is the rm path of every box, kvbox rm's and a reaper's: the box
// goes, and the snapshot it was cloned from with it when that snapshot's own
// TTL has passed and this was its last clone.
func (a *app) removeBox(ctx context.Context, h *domain.Host, name string, force bool) error {
	return a.removeBoxIf(ctx, h, name, force, nil)
}

// removeBoxIf is removeBox of the box as it is under its lock, if check
// (nil: none) passes it (domain.RemoveIf): a TTL's removal checks the box
// is the one that expired.
func (a *app) removeBoxIf(ctx context.Context, h *domain.Host, name string, force bool, check func(domain.Box) error) error {
	var b domain.Box
	var base string // the image version a box made from an image builds on
	err := h.RemoveIf(ctx, name, force, func(cur domain.Box) error {
		if check != nil {
			if err := check(cur); err != nil {
				return err
			}
		}
		b = cur
		if cur.Snapshot == "" && cur.Dir != "" {
			base, _ = overlay.BackingFile(cur.Disk())
		}
		return a.stopPublish(cur)
	})
	if err != nil {
		return err
	}
	a.forgetPublish(name)
	if b.Snapshot != "" {
		a.reapSnapshotIfDue(ctx, h, b.Snapshot, "")
	}
	a.pruneImageVersion(ctx, h, base)
	return nil
}

// pruneImageVersion removes the old version of an image that disk is, once
// the last box or snapshot on it is gone; a failure is only said (what was
// asked for is done).
func (a *app) pruneImageVersion(ctx context.Context, h *domain.Host, disk string) {
	if disk == "" {
		return
	}
	if err := snapshot.PruneVersionOf(ctx, h, a.snapshots(), a.images(), disk); err != nil {
		fmt.Fprintf(a.io.Err, "kvbox: warning: old versions of its image stay: %s\n", message(err))
	}
}

// reapSnapshotIfDue removes an expired snapshot no box is cloned from any
// more, if it is the one id names (snapshotID; "" for any); removed says it
// did. Its deadline and identity are checked again under the host lock,
// where the removal happens: a snapshot made since under its name is not
// the one that expired.
func (a *app) reapSnapshotIfDue(ctx context.Context, h *domain.Host, name, id string) (removed bool, clones []string, err error) {
	s, err := a.snapshots().Get(name)
	if err != nil || s.Expires == nil || time.Now().Before(*s.Expires) {
		return false, nil, nil
	}
	err = snapshot.RemoveIf(h, a.snapshots(), name, dueSnapshot(id))
	if errors.Is(err, base.ErrNotDue) || errors.Is(err, base.ErrNotFound) {
		return false, nil, nil
	}
	if errors.Is(err, base.ErrBusy) {
		clones, _ := snapshot.Clones(h, name)
		return false, clones, nil
	}
	if err != nil {
		return false, nil, err
	}
	h.StopReaper(domain.ReapSnapshot, name)
	a.pruneImageVersion(ctx, h, s.BaseDisk)
	return true, nil, nil
}

// setSnapshotTTL records a snapshot's deadline and starts its reaper.
func (a *app) setSnapshotTTL(h *domain.Host, name string, at time.Time) (snapshot.Snapshot, error) {
	s, err := snapshot.SetExpires(h, a.snapshots(), name, &at)
	if err != nil {
		return snapshot.Snapshot{}, err
	}
	h.StopReaper(domain.ReapSnapshot, name)
	return s, h.StartReaper(domain.ReapSnapshot, name, snapshotID(s))
}

// snapshotID tells a snapshot from a later one of the same name.
func snapshotID(s snapshot.Snapshot) string { return s.Created.UTC().Format(time.RFC3339Nano) }

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

// reaperCommand re-runs this kvbox, with the global flags it was given, as
// the reaper of KIND NAME.
func (a *app) reaperCommand(kind, name, id string) *exec.Cmd {
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	// The reaper runs in /: a path given relative to this command's
	// working directory would name another folder there.
	stateDir, template := absOr(a.stateDir), absOr(a.template)
	args := []string{"--connect", a.uri, "--state-dir", stateDir, "--bridge", a.bridge, "--subnet", a.subnet}
	if template != "" {
		args = append(args, "--template", template)
	}
	if a.domType != "" {
		args = append(args, "--domain-type", a.domType)
	}
	cmd := exec.Command(exe, append(args, domain.ReaperArg, kind, name, id)...)
	cmd.Dir = "/"
	// Test hooks (kill points, silent agents) are for the command that was
	// run, not for the reapers it leaves behind.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVBOX_TEST_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	return cmd
}

// SweepExpired is what every kvbox command does first (after a reboot no
// reaper runs): boxes and snapshots whose deadline has passed are removed
// (under their locks, through the rm path), and every other deadline gets
// its reaper back if it has none.
func (a *app) sweepExpired(h *domain.Host) {
	ctx := context.Background()
	boxes, err := h.Boxes()
	if err != nil {
		fmt.Fprintf(a.io.Err, "kvbox: warning: looking for expired boxes: %v\n", err)
		return
	}
	for _, b := range boxes {
		// A box of another state dir on the same libvirt has its own
		// kvbox, reapers and sweep.
		if b.Expires == nil || filepath.Dir(b.Dir) != h.Layout().Boxes() {
			continue
		}
		if !time.Now().Before(*b.Expires) && b.OnExpiry == domain.ExpirySuspend {
			if b.State != domain.StateRunning {
				continue // its reaper, or kvbox resume, deals with it
			}
			if err := a.suspendDue(ctx, h, b.Name, b.UUID); err == nil {
				fmt.Fprintf(a.io.Err, "kvbox: suspended box %s, whose TTL ended at %s\n", b.Name, b.Expires.Format(time.RFC3339))
			} else if !errors.Is(err, base.ErrNotFound) && !errors.Is(err, base.ErrNotDue) {
				fmt.Fprintf(a.io.Err, "kvbox: warning: suspending expired box %s: %v\n", b.Name, err)
			}
			continue
		}
		if !time.Now().Before(*b.Expires) {
			step.KillPoint("sweep-expired-box")
			// By identity: a box removed meanwhile may have a successor
			// of the same name, which this deadline is not.
			err := a.removeBoxIf(ctx, h, b.Name, true, domain.DueBox(b.UUID))
			if err == nil {
				fmt.Fprintf(a.io.Err, "kvbox: removed box %s, whose TTL ended at %s\n", b.Name, b.Expires.Format(time.RFC3339))
			} else if !errors.Is(err, base.ErrNotFound) && !errors.Is(err, base.ErrNotDue) {
				fmt.Fprintf(a.io.Err, "kvbox: warning: removing expired box %s: %v\n", b.Name, err)
			}
			continue
		}
		if !h.ReaperAlive(domain.ReapBox, b.Name) {
			h.StartReaper(domain.ReapBox, b.Name, b.UUID)
		}
	}
	snaps, _ := a.snapshots().List()
	for _, s := range snaps {
		if s.Expires == nil {
			continue
		}
		if !time.Now().Before(*s.Expires) {
			if removed, _, err := a.reapSnapshotIfDue(ctx, h, s.Name, snapshotID(s)); removed {
				fmt.Fprintf(a.io.Err, "kvbox: removed snapshot %s, whose TTL ended at %s\n", s.Name, s.Expires.Format(time.RFC3339))
			} else if err != nil {
				fmt.Fprintf(a.io.Err, "kvbox: warning: removing expired snapshot %s: %v\n", s.Name, err)
			}
			continue
		}
		if !h.ReaperAlive(domain.ReapSnapshot, s.Name) {
			h.StartReaper(domain.ReapSnapshot, s.Name, snapshotID(s))
		}
	}
}

// newCmdReap is the hidden reaper: `kvbox __reap box NAME UUID` or
// `kvbox __reap snapshot NAME CREATED`. It runs detached (StartReaper) and
// exits when the thing is removed, gone, given another identity, or has no
// deadline any more.
func (a *app) newCmdReap() *cobra.Command {
	return &cobra.Command{
		Use:     domain.ReaperArg + " KIND NAME ID",
		Hidden:  true,
		Example: "  (started by kvbox itself: kvbox ttl, new --ttl, snapshots new --ttl)",
		Args:    exactArgs(3, "a kind (box or snapshot), a name and an id"),
		RunE: func(c *cobra.Command, args []string) error {
			a.reaper = true
			return a.runReaper(c.Context(), args[0], args[1], args[2])
		},
	}
}

func (a *app) runReaper(ctx context.Context, kind, name, id string) error {
	if kind != domain.ReapBox && kind != domain.ReapSnapshot {
		return fmt.Errorf("%w: reaper kind %q", errUsage, kind)
	}
	logf := func(format string, v ...any) {
		fmt.Fprintf(a.io.Err, "%s reaper[%d] %s %s: %s\n", time.Now().UTC().Format(time.RFC3339), os.Getpid(), kind, name, fmt.Sprintf(format, v...))
	}
	h, err := a.Host()
	if err != nil {
		logf("%v", err)
		return err
	}
	held, ok, err := h.HoldReaper(kind, name)
	if err != nil {
		logf("%v", err)
		return err
	}
	if !ok {
		return nil // another reaper has it
	}
	defer held.Release()
	logf("started")
	for first := true; ; first = false {
		// A connection that slept may have been dropped by libvirtd (or
		// libvirtd restarted): every wake after the first uses a new one.
		if !first {
			a.reconnect(h)
		}
		// The deadline is read anew on every wake: kvbox ttl only rewrites it.
		at, gone, err := a.deadline(h, kind, name, id)
		if err != nil {
			logf("reading the deadline: %v (trying again in 10s)", err)
			a.reconnect(h)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(10 * time.Second):
			}
			continue
		}
		if gone || at == nil {
			logf("nothing to do (gone, or no deadline any more)")
			return nil
		}
		left := time.Until(*at)
		if left <= 0 {
			return a.reap(ctx, h, kind, name, id, logf)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(min(left, domain.ReaperRecheck)):
		}
	}
}

// deadline reads the deadline of the box or snapshot the reaper waits for;
// gone says it is not there any more (or a new one has its name).
func (a *app) deadline(h *domain.Host, kind, name, id string) (at *time.Time, gone bool, err error) {
	if kind == domain.ReapBox {
		b, err := h.Get(name)
		if errors.Is(err, base.ErrNotFound) {
			return nil, true, nil
		}
		if err != nil {
			return nil, false, err
		}
		return b.Expires, b.UUID != id, nil
	}
	s, err := a.snapshots().Get(name)
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
func (a *app) reap(ctx context.Context, h *domain.Host, kind, name, id string, logf func(string, ...any)) error {
	if kind == domain.ReapSnapshot {
		removed, clones, err := a.reapSnapshotIfDue(ctx, h, name, id)
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
	if b, err := h.Get(name); err == nil && b.OnExpiry == domain.ExpirySuspend {
		err := a.suspendDue(ctx, h, name, id)
		switch {
		case errors.Is(err, base.ErrNotFound):
			logf("nothing to do (gone)")
		case errors.Is(err, base.ErrNotDue):
			logf("nothing suspended: %v", err)
		case err != nil:
			logf("suspending the expired box: %v", err)
			return err
		default:
			logf("suspended: its TTL ended (it has no deadline while suspended)")
		}
		return nil
	}
	err := a.removeBoxIf(ctx, h, name, true, domain.DueBox(id))
	switch {
	case errors.Is(err, base.ErrNotFound):
		logf("nothing to do (gone)")
	case errors.Is(err, base.ErrNotDue):
		logf("nothing removed: %v", err)
	case err != nil:
		logf("removing the expired box: %v", err)
		return err
	default:
		logf("removed: its TTL ended")
	}
	return nil
}

// suspendDue suspends a box whose deadline suspends it (OnExpiry), if
// under its lock it is still the box with UUID uuid and its deadline has
// passed, and takes the deadline away.
func (a *app) suspendDue(ctx context.Context, h *domain.Host, name, uuid string) error {
	_, err := suspend.SuspendWith(ctx, h, name, suspend.SuspendOptions{Check: domain.DueBox(uuid), ClearExpires: true})
	return err
}

// reconnect replaces a broken libvirt connection (libvirtd restarted).
func (a *app) reconnect(h *domain.Host) {
	c, err := domain.Connect(h.URI)
	if err != nil {
		return
	}
	h.Close()
	h.SetConn(c)
}
