package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/qmp"
	"kvbox.dev/kvbox/revert"
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

// partial is what a snapshot in progress records in its temporary folder
// before it changes anything, so Recover can undo it when kvbox dies.
type partial struct {
	Name    string          `json:"name"`
	Box     string          `json:"box"`
	BoxUUID string          `json:"box_uuid"`
	PID     int             `json:"pid"`
	Caps    map[string]bool `json:"caps"` // migration capabilities as they were
	Bitmap  string          `json:"bitmap"`
	Paused  bool            `json:"paused"` // the box ran before kvbox paused it
	// Params are the migration parameters a live copy changed, as they
	// were (json.Number values, set back as they are).
	Params map[string]any `json:"params,omitempty"`
}

const partialFile = "partial.json"

// liveParams are the migration parameters of a live memory copy: QEMU's
// default max-bandwidth (128 MiB/s) makes a 1.5 GB copy take 12 s; at
// 10 GiB/s it is bounded by the disk and the guest (DESIGN.md).
var liveParams = map[string]any{"max-bandwidth": int64(10 << 30)}

// partialDir is where a snapshot is built before it is renamed into place.
func (st Store) partialDir(name string) string { return filepath.Join(st.Dir, "."+name+".partial") }

// Result reports how a snapshot went.
type Result struct {
	Snapshot Snapshot
	Pause    time.Duration // how long the box was paused
	Steps    []Step
}

// Step is one timed step of taking a snapshot.
type Step struct {
	Name     string
	Duration time.Duration
}

// Create snapshots the running box into a new snapshot named name. The box is
// paused while its memory and device state are saved and is running again
// before the disk copy finishes: the backup job copies point-in-time in the
// background.
func Create(ctx context.Context, h *domain.Host, st Store, boxName, name string) (res Result, err error) {
	if err := domain.ValidName(name); err != nil {
		return Result{}, err
	}
	box, dom, release, err := h.LockedLookup(boxName)
	if err != nil {
		return Result{}, err
	}
	defer release()
	if box.State != "running" {
		return Result{}, fmt.Errorf("box %q is %s; kvbox snapshots a running box: %w", boxName, box.State, domain.ErrBusy)
	}
	if err := os.MkdirAll(st.Dir, domain.SharedDirMode); err != nil {
		return Result{}, err
	}
	// The name is taken by a complete snapshot, or by one in progress.
	unlockName, err := lockName(st, name)
	if err != nil {
		return Result{}, err
	}
	defer unlockName()
	if _, err := os.Stat(filepath.Join(st.Dir, name)); err == nil {
		return Result{}, fmt.Errorf("snapshot %q %w (kvbox snapshots rm %s, or pick another name)", name, domain.ErrExists, name)
	}

	t := &timer{start: time.Now()}
	q := qmp.NewDomainClient(dom)
	tmp := st.partialDir(name)
	os.RemoveAll(tmp) // ours: we hold the name lock
	if err := os.Mkdir(tmp, 0o750); err != nil {
		return Result{}, err
	}
	r := revert.New()
	defer r.Fail()
	r.Add(func() { os.RemoveAll(tmp) })
	if err := h.ChownForQEMU(tmp); err != nil { // QEMU writes the state and the disk here
		return Result{}, err
	}

	// What the disk part builds on.
	top, err := q.TopNode(ctx, diskDevice)
	if err != nil {
		return Result{}, fmt.Errorf("find the disk of box %q: %w", boxName, err)
	}
	chain, err := overlay.InfoChain(ctx, filepath.Join(box.Dir, "disk.qcow2"))
	if err != nil {
		return Result{}, err
	}
	if len(chain) < 2 {
		return Result{}, fmt.Errorf("the disk of box %q has no base image", boxName)
	}
	base := chain[len(chain)-1]
	prev, err := previous(ctx, q, st, top, box)
	if err != nil {
		return Result{}, err
	}
	liveXML, err := dom.GetXMLDesc(libvirt.DOMAIN_XML_MIGRATABLE)
	if err != nil {
		return Result{}, fmt.Errorf("read the domain XML of %q: %w", boxName, err)
	}
	// A box booted from an image has its RAM in a file of its own, shared
	// with QEMU: x-ignore-shared skips it and kvbox copies the file. A
	// running clone maps a snapshot's file privately: its RAM goes into the
	// state file in mapped-ram layout instead.
	mapped := !strings.Contains(liveXML, domain.SharedRAMArgs(box.MemoryBytes, domain.MemoryFile(box.Dir))[1])
	caps := map[string]bool{qmp.CapIgnoreShared: !mapped, "mapped-ram": mapped}
	saved, err := q.QueryMigrateCapabilities(ctx)
	if err != nil {
		return Result{}, err
	}
	p := partial{Name: name, Box: boxName, BoxUUID: box.UUID, PID: os.Getpid(), Caps: map[string]bool{},
		Bitmap: bitmapPrefix + name, Paused: true}
	if mapped {
		caps[qmp.CapPauseBeforeSwitchover] = false
	}
	for k := range caps {
		p.Caps[k] = saved[k]
	}
	if mapped {
		cur, err := q.QueryMigrateParameters(ctx)
		if err != nil {
			return Result{}, err
		}
		p.Params = map[string]any{}
		for k := range liveParams {
			v, ok := cur[k]
			if !ok {
				return Result{}, fmt.Errorf("QEMU does not report migration parameter %q; kvbox could not set it back", k)
			}
			p.Params[k] = v
		}
	}
	if err := writeJSON(filepath.Join(tmp, partialFile), p); err != nil {
		return Result{}, err
	}

	// The target of the disk copy: a qcow2 over what the copied blocks sit
	// on (the previous snapshot's disk for an incremental copy, else the
	// box disk's own backing file).
	targetBacking, targetFmt := chain[1].Filename, chain[1].Format
	if prev != nil {
		targetBacking, targetFmt = prev.Path(DiskFile), "qcow2"
	}
	disk := filepath.Join(tmp, DiskFile)
	// The backup target must have the source's size exactly.
	if err := overlay.CreateLarger(ctx, disk, targetBacking, targetFmt, chain[0].VirtualSize); err != nil {
		return Result{}, err
	}
	if err := h.ChownForQEMU(disk); err != nil {
		return Result{}, err
	}
	if err := overlay.WriteFileAtomic(filepath.Join(tmp, DomainXMLFile), []byte(liveXML), 0o640); err != nil {
		return Result{}, err
	}
	t.step("prepare")
	domain.Testpoint("prepared")

	// The pause: everything from here to Resume is time the box stands still.
	var pauseStart time.Time
	running := false
	resume := func() {
		if !running {
			running = true
			// After an outgoing migration QEMU's block nodes are inactive;
			// cont needs them active.
			q.BlockdevSetActive(context.WithoutCancel(ctx), "", true)
			dom.Resume()
		}
	}
	if mapped {
		// A clone's RAM is copied while it runs: precopy into the
		// mapped-ram file, QEMU's dirty tracking re-sending what the guest
		// writes meanwhile. QEMU stops the box itself for the last pass
		// and the device state, and leaves it stopped (postmigrate), so
		// the disk's point-in-time below is taken at the switch-over.
		if err := q.MigrateSetCapabilities(ctx, caps); err != nil {
			return Result{}, err
		}
		r.Add(func() { q.MigrateSetCapabilities(context.WithoutCancel(ctx), p.Caps) })
		if err := q.MigrateSetParameters(ctx, liveParams); err != nil {
			return Result{}, err
		}
		r.Add(func() { q.MigrateSetParameters(context.WithoutCancel(ctx), p.Params) })
		r.Add(resume) // runs after the cancel below: QEMU may have stopped the box
		r.Add(func() {
			// A copy cut short: no migration may be left running.
			bg := context.WithoutCancel(ctx)
			if s, err := q.QueryMigrate(bg); err == nil && qmp.MigrationRunning(s.Status) {
				q.MigrateCancel(bg)
				q.WaitMigration(bg, 5*time.Millisecond)
			}
		})
		if err := q.Migrate(ctx, "file:"+filepath.Join(tmp, StateFile)); err != nil {
			return Result{}, err
		}
		domain.Testpoint("live-started")
		stopped, err := q.WaitMigrationStop(ctx, 2*time.Millisecond, func(s qmp.MigrateStatus) {
			if s.RAM != nil {
				domain.Testpoint("live-copying")
			}
		})
		if err != nil {
			return Result{}, fmt.Errorf("save the state of box %q: %w", boxName, err)
		}
		pauseStart = stopped
		t.step("copy memory live")
	} else {
		pauseStart = time.Now()
		if err := dom.Suspend(); err != nil {
			return Result{}, fmt.Errorf("pause box %q: %w", boxName, err)
		}
		r.Add(resume)
		domain.Testpoint("paused")
		if err := q.MigrateSetCapabilities(ctx, caps); err != nil {
			return Result{}, err
		}
		r.Add(func() { q.MigrateSetCapabilities(context.WithoutCancel(ctx), p.Caps) })
		if err := q.Migrate(ctx, "file:"+filepath.Join(tmp, StateFile)); err != nil {
			return Result{}, err
		}
		if err := q.WaitMigration(ctx, 2*time.Millisecond); err != nil {
			return Result{}, fmt.Errorf("save the state of box %q: %w", boxName, err)
		}
	}
	t.step("save device state")
	domain.Testpoint("state-saved")
	mem := Memory{File: StateFile, MappedRAM: true}
	if !mapped {
		mem = Memory{File: MemoryFile}
		// Not synced here: seal syncs every file once the box runs again.
		if _, err := overlay.CopySparseNoSync(filepath.Join(tmp, MemoryFile), domain.MemoryFile(box.Dir)); err != nil {
			return Result{}, fmt.Errorf("copy the memory of box %q: %w", boxName, err)
		}
		t.step("copy memory")
	}
	domain.Testpoint("memory-copied")
	if err := q.BlockdevSetActive(ctx, "", true); err != nil {
		return Result{}, err
	}
	if err := q.BlockdevAdd(ctx, map[string]any{
		"driver": "qcow2", "node-name": targetNode, "backing": nil,
		"file": map[string]any{"driver": "file", "filename": disk},
	}); err != nil {
		return Result{}, fmt.Errorf("open the snapshot disk: %w", err)
	}
	r.Add(func() { q.BlockdevDel(context.WithoutCancel(ctx), targetNode) })
	backup := qmp.BackupArgs{JobID: backupJob, Device: top, Target: targetNode, Sync: qmp.SyncTop, AutoDismiss: qmp.Bool(false)}
	if prev != nil {
		backup.Sync, backup.Bitmap, backup.BitmapMode = "bitmap", prev.Bitmap, qmp.BitmapNever
	}
	if err := q.Transaction(ctx,
		qmp.BitmapAddAction(qmp.BitmapAddArgs{Node: top, Name: p.Bitmap, Persistent: true}),
		qmp.BackupAction(backup),
	); err != nil {
		return Result{}, fmt.Errorf("start the disk copy: %w", err)
	}
	r.Add(func() {
		bg := context.WithoutCancel(ctx)
		q.JobCancel(bg, backupJob)
		q.WaitJob(bg, backupJob, 10*time.Millisecond)
		q.BlockDirtyBitmapRemove(bg, top, p.Bitmap)
	})
	domain.Testpoint("backup-started")
	if err := q.MigrateSetCapabilities(ctx, p.Caps); err != nil {
		return Result{}, err
	}
	if p.Params != nil {
		if err := q.MigrateSetParameters(ctx, p.Params); err != nil {
			return Result{}, err
		}
	}
	resume()
	pause := time.Since(pauseStart)
	t.step("resume")
	domain.Testpoint("resumed")

	// The box runs again; the backup job copies the disk as it was at the
	// pause (copy-before-write).
	if err := q.WaitJob(ctx, backupJob, 20*time.Millisecond); err != nil {
		return Result{}, fmt.Errorf("copy the disk of box %q: %w", boxName, err)
	}
	if err := q.BlockdevDel(ctx, targetNode); err != nil {
		return Result{}, err
	}
	t.step("copy disk")
	copied, _ := overlay.Du(disk)
	domain.Testpoint("disk-copied")
	// Merge: the new disk then stands alone above the base image, so
	// deleting an older snapshot never breaks this one.
	if targetBacking != base.Filename {
		if err := overlay.Rebase(ctx, disk, base.Filename, base.Format, false); err != nil {
			return Result{}, fmt.Errorf("merge the snapshot disk: %w", err)
		}
		t.step("merge disk")
	}
	if mapped {
		if mem.Offset, err = prepareMappedRAM(filepath.Join(tmp, StateFile), box.MemoryBytes); err != nil {
			return Result{}, err
		}
	}
	domain.Testpoint("merged")

	snap := Snapshot{
		Name: name, Box: boxName, BoxUUID: box.UUID, Created: time.Now().UTC(), Image: box.Image,
		BaseDisk: base.Filename, BaseFormat: base.Format, Parent: box.Snapshot, Memory: mem,
		CPUs: box.CPUs, MemoryBytes: box.MemoryBytes, DiskBytes: box.DiskBytes, Bitmap: p.Bitmap,
		Incremental: prev != nil, DiskCopiedBytes: copied, PauseMillis: pause.Milliseconds(),
	}
	if err := seal(h, tmp, snap); err != nil {
		return Result{}, err
	}
	domain.Testpoint("sealed")
	if err := os.Rename(tmp, filepath.Join(st.Dir, name)); err != nil {
		return Result{}, err
	}
	r.Success()
	if err := overlay.SyncDir(st.Dir); err != nil {
		return Result{}, err
	}
	// The previous snapshot's bitmap is spent: the new one tracks changes
	// from here on.
	if prev != nil {
		q.BlockDirtyBitmapRemove(ctx, top, prev.Bitmap)
	}
	t.step("seal")
	snap, err = st.Get(name)
	return Result{Snapshot: snap, Pause: pause, Steps: t.steps}, err
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

// seal makes a built snapshot folder durable and read-only: every file is
// synced, snapshot.json is written last, and the files belong to root again.
func seal(h *domain.Host, dir string, s Snapshot) error {
	os.Remove(filepath.Join(dir, partialFile))
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		err = f.Sync()
		f.Close()
		if err != nil {
			return fmt.Errorf("sync %s: %w", p, err)
		}
		// Root's, read-only to QEMU through its group, nothing for others.
		if err := h.ShareWithQEMU(p, domain.SharedFileMode); err != nil {
			return err
		}
	}
	if err := writeJSON(filepath.Join(dir, MetaFile), s); err != nil {
		return err
	}
	if err := h.ShareWithQEMU(filepath.Join(dir, MetaFile), domain.SharedFileMode); err != nil {
		return err
	}
	return h.ShareWithQEMU(dir, domain.SharedDirMode)
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return overlay.WriteFileAtomic(path, append(b, '\n'), 0o640)
}

// lockName holds a snapshot name while a snapshot of that name is built or
// recovered; the lock file goes with the unlock.
func lockName(st Store, name string) (func(), error) {
	l, err := domain.LockFile(filepath.Join(st.Dir, "."+name+".lock"), false)
	if errors.Is(err, domain.ErrLocked) {
		return nil, fmt.Errorf("snapshot %q is being taken by another kvbox: %w", name, domain.ErrBusy)
	}
	if err != nil {
		return nil, err
	}
	return l.RemoveAndUnlock, nil
}

type timer struct {
	start, last time.Time
	steps       []Step
}

func (t *timer) step(name string) {
	now := time.Now()
	if t.last.IsZero() {
		t.last = t.start
	}
	t.steps = append(t.steps, Step{name, now.Sub(t.last)})
	t.last = now
}
