package kvbox

import (
	"context"
	"fmt"
	"sync"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/progress"
	"kvbox.dev/kvbox/snapshot"
)

// SnapshotOptions are a new snapshot's deadline and where it reports.
type SnapshotOptions struct {
	// Expires removes the snapshot then, or once its last clone is
	// removed if it has clones then.
	Expires  *time.Time
	Progress progress.Reporter
}

// Snapshot freezes box's memory, CPU and device state and disk into
// snapshot name while the box runs on (a stopped box is booted for it and
// stopped again).
func (h *Host) Snapshot(ctx context.Context, box, name string, o SnapshotOptions) (snapshot.Result, error) {
	p := progress.Of(o.Progress)
	var mu sync.Mutex
	var saving progress.Stage
	phases := snapshot.Phases{
		Booting: func() func() {
			p.Log(fmt.Sprintf("box %s is stopped: booting it for the snapshot, it is stopped again afterwards", box))
			return p.Stage("booting " + box).End
		},
		Saving: func() func() {
			st := p.Stage("saving " + box + " as " + name)
			mu.Lock()
			saving = st
			mu.Unlock()
			return st.End
		},
		Copying: func(cp snapshot.CopyProgress) {
			mu.Lock()
			defer mu.Unlock()
			if saving != nil {
				saving.Status(copyLine(cp))
			}
		},
	}
	res, err := snapshot.CreateOf(ctx, h.d, h.snaps, box, name, phases)
	if err != nil || o.Expires == nil {
		return res, err
	}
	if res.Snapshot, err = h.SetSnapshotExpires(ctx, name, o.Expires); err != nil {
		return res, fmt.Errorf("snapshot %s is saved but got no TTL (kvbox snapshots rm %s): %w", name, name, err)
	}
	return res, nil
}

// copyLine is the status of a memory copy in progress.
func copyLine(p snapshot.CopyProgress) string {
	how := "live while it runs"
	if p.Paused {
		how = "while it is paused (TCG)"
	}
	return fmt.Sprintf("memory copied %s: %s written, %d%% of its RAM gone through",
		how, base.FormatSize(p.Written), p.Scanned*100/max(p.RAM, 1))
}

// SnapshotInfo is a snapshot as kvbox lists it, with the boxes cloned
// from it (kvbox snapshots ls --json).
type SnapshotInfo struct {
	snapshot.Snapshot
	Clones []string `json:"clones"`
}

// Snapshots lists this state dir's snapshots, oldest first.
func (h *Host) Snapshots(ctx context.Context) ([]SnapshotInfo, error) {
	boxes, err := h.d.Boxes()
	if err != nil {
		return nil, err
	}
	snaps, err := h.snaps.List()
	if err != nil {
		return nil, err
	}
	out := []SnapshotInfo{}
	for _, s := range snaps {
		r := SnapshotInfo{Snapshot: s, Clones: []string{}}
		for _, b := range boxes {
			if b.Snapshot == s.Name {
				r.Clones = append(r.Clones, b.Name)
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// GetSnapshot is the named snapshot.
func (h *Host) GetSnapshot(ctx context.Context, name string) (snapshot.Snapshot, error) {
	return h.snaps.Get(name)
}

// SnapshotOwner is the program that keeps snapshot name for itself (its
// owner mark, snapshot.OwnerFile: kvbox-node's cache), "" for one no
// program marked. A front that lets others make, clone or remove
// snapshots leaves a marked one alone; a mark that cannot be read is
// reported as an error, which such a front takes as a mark.
func (h *Host) SnapshotOwner(ctx context.Context, name string) (string, error) {
	s, err := h.snaps.Get(name)
	if err != nil {
		return "", err
	}
	o, ok, err := snapshot.OwnerOf(s)
	if err != nil || !ok {
		return "", err
	}
	return o.Owner, nil
}
