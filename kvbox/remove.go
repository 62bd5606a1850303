package kvbox

import (
	"context"
	"errors"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/snapshot"
)

// Remove deletes a box: its port holder and reaper, its domain, folder
// (disk, saved state) and address; then the snapshot it was
// cloned from, if that snapshot's own TTL has passed and this was its last
// clone, and the old version of its image it was the last to build on. A
// running box is only removed with force. This is every box's removal:
// kvbox rm's, a TTL's, a failed creation's.
func (h *Host) Remove(ctx context.Context, name string, force bool) error {
	return h.removeIf(ctx, name, force, nil)
}

// removeIf is Remove of the box as it is under its lock, if check (nil:
// none) passes it (domain.Host.RemoveIf): a TTL's removal checks that the
// box is the one that expired.
func (h *Host) removeIf(ctx context.Context, name string, force bool, check func(domain.Box) error) error {
	var b domain.Box
	var baseDisk string // the image version a box made from an image builds on
	err := h.d.RemoveIf(ctx, name, force, func(cur domain.Box) error {
		if check != nil {
			if err := check(cur); err != nil {
				return err
			}
		}
		b = cur
		if cur.Snapshot == "" && cur.Dir != "" {
			baseDisk, _ = overlay.BackingFile(cur.Disk())
		}
		if err := h.stopPublish(cur); err != nil {
			return err
		}
		h.stopReaper(ReapBox, name)
		h.dropForwarder(name)
		return nil
	})
	if err != nil {
		return err
	}
	h.forgetPublish(name)
	if b.Snapshot != "" {
		h.reapSnapshotIfDue(ctx, b.Snapshot, "")
	}
	h.pruneImageVersion(ctx, baseDisk)
	return nil
}

// pruneImageVersion removes the old version of an image that disk is, once
// the last box or snapshot on it is gone; a failure is only said (what was
// asked for is done).
func (h *Host) pruneImageVersion(ctx context.Context, disk string) {
	if disk == "" {
		return
	}
	if err := snapshot.PruneVersionOf(ctx, h.d, h.snaps, h.images, disk); err != nil {
		h.notify(true, "old versions of its image stay: %v", err)
	}
}

// reapSnapshotIfDue removes an expired snapshot no box is cloned from any
// more, if it is the one id names (snapshotID; "" for any); removed says it
// did, clones are the boxes that keep it. Its deadline and identity are
// checked again under the host lock, where the removal happens: a snapshot
// made since under its name is not the one that expired.
func (h *Host) reapSnapshotIfDue(ctx context.Context, name, id string) (removed bool, clones []string, err error) {
	s, err := h.snaps.Get(name)
	if err != nil || s.Expires == nil || time.Now().Before(*s.Expires) {
		return false, nil, nil
	}
	err = snapshot.RemoveIf(ctx, h.d, h.snaps, name, dueSnapshot(id))
	switch {
	case errors.Is(err, base.ErrNotDue), errors.Is(err, base.ErrNotFound):
		return false, nil, nil
	case errors.Is(err, base.ErrBusy):
		clones, _ := snapshot.Clones(h.d, name)
		return false, clones, nil
	case err != nil:
		return false, nil, err
	}
	h.stopReaper(ReapSnapshot, name)
	h.pruneImageVersion(ctx, s.BaseDisk)
	return true, nil, nil
}

// RemoveSnapshot deletes a snapshot no box is cloned from, ends its
// reaper, and removes the old image version it was the last to build on.
func (h *Host) RemoveSnapshot(ctx context.Context, name string) error {
	s, err := h.snaps.Get(name)
	if err != nil {
		return err
	}
	if err := snapshot.Remove(ctx, h.d, h.snaps, s.Name); err != nil {
		return err
	}
	h.stopReaper(ReapSnapshot, s.Name)
	h.pruneImageVersion(ctx, s.BaseDisk)
	return nil
}

// RemoveMany removes every named box (each name once), several at a time,
// and tells done (one call at a time) each box's outcome as it ends. With
// force a name that is no box is skipped quietly, as rm -f does: it has no
// outcome. The error is nil when nothing failed, the only failure's for
// one name, else a ManyError naming the boxes that failed (its kind that
// of the first failure).
func (h *Host) RemoveMany(ctx context.Context, names []string, force bool, done func(Outcome)) error {
	var (
		mu     sync.Mutex
		failed []string
		first  error
		wg     sync.WaitGroup
		slots  = make(chan struct{}, 8)
	)
	var unique []string
	for _, n := range names {
		if !slices.Contains(unique, n) {
			unique = append(unique, n)
		}
	}
	for _, n := range unique {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slots <- struct{}{}
			t0 := time.Now()
			err := h.Remove(ctx, n, force)
			<-slots
			mu.Lock()
			defer mu.Unlock()
			var nb domain.NoBoxError
			if force && errors.As(err, &nb) {
				return
			}
			if err != nil {
				failed = append(failed, n)
				if first == nil {
					first = err
				}
			}
			if done != nil {
				done(Outcome{Name: n, Took: time.Since(t0), Err: err})
			}
		}()
	}
	wg.Wait()
	if first == nil || len(unique) == 1 {
		return first
	}
	sort.Strings(failed)
	return &ManyError{"could not remove " + strings.Join(failed, ", "), first}
}
