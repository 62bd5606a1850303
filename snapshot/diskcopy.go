package snapshot

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/qmp"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/vmstate"
)

// Names kvbox gives the things it adds to a running QEMU while it takes a
// snapshot. Recover removes them when a kvbox died half-way.
const (
	targetNode = "kvbox-snap-target"
	backupJob  = "kvbox-snap-backup"
	// bitmapPrefix starts the name of the persistent dirty bitmap that
	// tracks what changed on a box's disk since its last snapshot.
	bitmapPrefix = "kvbox-"
	diskDevice   = "virtio-disk0" // libvirt's alias of the box's vda
)

// diskCopy is the point-in-time copy of a box's disk into a snapshot's
// disk: taken by a backup job started in the pause, copied while the box
// runs, made to stand alone above the base image.
type diskCopy struct {
	q    *qmp.Client
	st   Store
	box  domain.Box
	path string // the copy's target, the snapshot's disk
	// bitmap is the dirty bitmap the snapshot leaves on the box's disk,
	// which tracks what changes until the next one.
	bitmap string

	chain   []overlay.ImageInfo // the box disk's backing chain, top first
	top     string              // the box disk's top block node
	prev    *Snapshot           // what an incremental copy builds on
	backing string              // what the target sits on
	copied  int64               // bytes the copy wrote
}

// readChain reads the box disk's backing chain.
func (d *diskCopy) readChain(ctx context.Context) (err error) {
	d.chain, err = overlay.InfoChain(ctx, d.box.Disk())
	if err == nil && len(d.chain) < 2 {
		err = fmt.Errorf("the disk of box %q has no base image", d.box.Name)
	}
	return err
}

// find finds the disk's top block node and the snapshot an incremental
// copy builds on.
func (d *diskCopy) find(ctx context.Context) (err error) {
	step.KillPoint("find-previous")
	if d.top, err = d.q.TopNode(ctx, diskDevice); err != nil {
		return fmt.Errorf("find the disk of box %q: %w", d.box.Name, err)
	}
	d.prev, err = previous(ctx, d.q, d.st, d.top, d.box)
	return err
}

func (d *diskCopy) base() overlay.ImageInfo { return d.chain[len(d.chain)-1] }

// makeTarget makes the copy's target, a qcow2 of the source disk's size
// that stands alone above the base image once the copied blocks are in.
// The copy writes the blocks that changed since what the target sits on:
// the previous snapshot's disk for an incremental copy, else what the box
// disk sits on (its image, or for a clone its snapshot's disk). A
// snapshot's disk stands alone above the base, so a target over one
// starts as a copy of it, made now, and needs no merge afterwards.
func (d *diskCopy) makeTarget(ctx context.Context) error {
	d.backing = d.chain[1].Filename
	format := d.chain[1].Format
	if d.prev != nil {
		d.backing, format = d.prev.Path(DiskFile), "qcow2"
	}
	base := d.base()
	if d.backing != base.Filename && format == "qcow2" {
		on, err := overlay.BackingFile(d.backing)
		if err != nil {
			return err
		}
		if on == base.Filename {
			return d.startFromStandalone(ctx, base)
		}
	}
	// Over the base, or over what is not one of kvbox's standalone
	// snapshot disks (merged after the copy).
	return overlay.CreateLarger(ctx, d.path, d.backing, format, d.chain[0].VirtualSize)
}

// startFromStandalone makes the target a copy of the standalone snapshot
// disk it would sit on (d.backing, itself over base), of the source disk's
// size at least.
func (d *diskCopy) startFromStandalone(ctx context.Context, base overlay.ImageInfo) error {
	if _, err := overlay.CopySparse(d.path, d.backing); err != nil {
		return fmt.Errorf("start the snapshot disk from %s: %w", d.backing, err)
	}
	if err := os.Chmod(d.path, 0o640); err != nil { // a sealed disk is read-only
		return err
	}
	d.backing = base.Filename
	size, err := overlay.VirtualSize(d.path)
	if err != nil {
		return err
	}
	if size < d.chain[0].VirtualSize {
		return overlay.Resize(ctx, d.path, d.chain[0].VirtualSize)
	}
	return nil
}

// openTarget opens the target in QEMU.
func (d *diskCopy) openTarget(ctx context.Context) error {
	if err := d.q.BlockdevAdd(ctx, map[string]any{
		"driver": "qcow2", "node-name": targetNode, "backing": nil,
		"file": map[string]any{"driver": "file", "filename": d.path},
	}); err != nil {
		return fmt.Errorf("open the snapshot disk: %w", err)
	}
	return nil
}

func (d *diskCopy) closeTarget() { d.q.BlockdevDel(context.Background(), targetNode) }

// startBackup starts the point-in-time copy (only the blocks changed
// since the previous snapshot when there is one) and, in the same
// transaction, the bitmap that tracks changes for the next snapshot.
func (d *diskCopy) startBackup(ctx context.Context) error {
	backup := qmp.BackupArgs{JobID: backupJob, Device: d.top, Target: targetNode, Sync: qmp.SyncTop, AutoDismiss: qmp.Bool(false), Speed: heldBackupSpeed}
	if d.prev != nil {
		backup.Sync, backup.Bitmap, backup.BitmapMode = "bitmap", d.prev.Bitmap, qmp.BitmapNever
	}
	if err := d.q.Transaction(ctx,
		qmp.BitmapAddAction(qmp.BitmapAddArgs{Node: d.top, Name: d.bitmap, Persistent: true}),
		qmp.BackupAction(backup),
	); err != nil {
		return fmt.Errorf("start the disk copy: %w", err)
	}
	return nil
}

// cancelBackup takes the copy and its bitmap back (best effort).
func (d *diskCopy) cancelBackup() {
	ctx, cancel := context.WithTimeout(context.Background(), vmstate.DefaultUndoLimit)
	defer cancel()
	d.q.JobCancel(ctx, backupJob)
	d.q.WaitJob(ctx, backupJob, 10*time.Millisecond)
	d.q.BlockDirtyBitmapRemove(ctx, d.top, d.bitmap)
}

// heldBackupSpeed is the disk copy's rate limit (bytes per second) from its
// start in the pause until the box runs again (copy lifts it). The
// point-in-time is the copy-before-write filter's, taken by the
// transaction; the copying itself runs in QEMU's main loop, where the
// box's resume is served too: unheld, the resume of a box that had written
// much to its disk waited behind the copy's first reads and writes
// (docs/design.md#disk-copy-in-the-pause).
const heldBackupSpeed = 1

// releaseBackup lifts the backup job's rate limit. A job that copied all
// within its held start (few blocks changed) may be past running already,
// and QEMU refuses a new limit then: it is done, and WaitJob finds it so.
func (d *diskCopy) releaseBackup(ctx context.Context) error {
	err := d.q.BlockJobSetSpeed(ctx, backupJob, 0)
	if err == nil {
		return nil
	}
	if jobs, qerr := d.q.QueryJobs(ctx); qerr == nil {
		if j := qmp.FindJob(jobs, backupJob); j != nil {
			switch j.Status {
			case qmp.JobWaiting, qmp.JobPending, qmp.JobAborting, qmp.JobConcluded, qmp.JobNull:
				return nil
			}
		}
	}
	return fmt.Errorf("let the disk copy run: %w", err)
}

// copy lets the backup job run (heldBackupSpeed) and waits for it: it
// copies the disk as it was at the pause (copy-before-write) while the box
// runs; then the target is closed.
func (d *diskCopy) copy(ctx context.Context) error {
	if err := d.releaseBackup(ctx); err != nil {
		return err
	}
	job, err := d.q.WaitJob(ctx, backupJob, 5*time.Millisecond)
	if err != nil {
		return fmt.Errorf("copy the disk of box %q: %w", d.box.Name, err)
	}
	d.copied = job.CurrentProgress
	return d.q.BlockdevDel(ctx, targetNode)
}

// merge makes the snapshot stand alone: the new disk is rebased onto the
// base image, so deleting an older snapshot never breaks this one.
func (d *diskCopy) merge(ctx context.Context) error {
	if base := d.base(); d.backing != base.Filename {
		if err := overlay.Rebase(ctx, d.path, base.Filename, base.Format, false); err != nil {
			return fmt.Errorf("merge the snapshot disk: %w", err)
		}
	}
	return nil
}

// dropPrevious removes the previous snapshot's bitmap, spent once a new
// snapshot is complete: the new one tracks changes from here on.
func (d *diskCopy) dropPrevious(ctx context.Context) {
	if d.prev != nil {
		d.q.BlockDirtyBitmapRemove(ctx, d.top, d.prev.Bitmap)
	}
}

// previous returns the newest snapshot of the box whose bitmap is still on
// the box's disk: the base of an incremental copy. Bitmaps of snapshots that
// are gone are removed.
func previous(ctx context.Context, q *qmp.Client, st Store, top string, box domain.Box) (*Snapshot, error) {
	nodes, err := q.QueryNamedBlockNodes(ctx)
	if err != nil {
		return nil, err
	}
	have := map[string]bool{}
	for _, n := range nodes {
		if n.NodeName != top {
			continue
		}
		for _, b := range n.DirtyBitmaps {
			if strings.HasPrefix(b.Name, bitmapPrefix) && !b.Inconsistent && b.Recording {
				have[b.Name] = true
			}
		}
	}
	snaps, err := st.List()
	if err != nil {
		return nil, err
	}
	var prev *Snapshot
	for i := range snaps {
		s := snaps[i]
		if s.BoxUUID == box.UUID && have[s.Bitmap] {
			prev = &s
		}
	}
	for b := range have {
		if prev == nil || b != prev.Bitmap {
			q.BlockDirtyBitmapRemove(ctx, top, b) // its snapshot is gone
		}
	}
	return prev, nil
}
