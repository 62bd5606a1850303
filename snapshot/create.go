package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/qmp"
	"kvbox.dev/kvbox/statedir"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/vmstate"
)

// Result reports how a snapshot went.
type Result struct {
	Snapshot Snapshot
	Pause    time.Duration // how long the box was paused
	Steps    step.Timings
	// Note, when set, says what went wrong after the snapshot was taken
	// and what kvbox does about it (the snapshot itself is whole).
	Note string
}

// Phases are what a caller is told as a snapshot goes (each may be nil).
// Booting and Saving are called as that phase begins and return what to
// call when it ends (a progress line); Copying reports a live copy's
// progress about every 100 ms.
type Phases struct {
	Booting, Saving func() (done func())
	Copying         func(CopyProgress)
}

// CopyProgress is how far a live memory copy is: the bytes of guest pages
// written so far (a page the guest writes again is written again), and
// how much of the RAM QEMU has gone through in its current pass.
type CopyProgress struct {
	Written, Scanned, RAM int64
	Paused                bool // the box stands still while it is copied (vmstate.Mode)
}

// CreateOf snapshots a box whatever its state: a stopped box is booted first
// (a snapshot holds a running machine, so that its clones start warm) and
// stopped again afterwards.
func CreateOf(ctx context.Context, h *domain.Host, st Store, boxName, name string, ph Phases) (Result, error) {
	if err := base.ValidName(name); err != nil {
		return Result{}, err
	}
	if _, err := st.Get(name); err == nil {
		return Result{}, base.Errorf(base.Exists, "snapshot %q already exists (kvbox snapshots rm %s, or pick another name)", name, name)
	}
	b, err := h.Get(boxName)
	if err != nil {
		return Result{}, err
	}
	phase := func(f func() func()) func() {
		if f == nil {
			return func() {}
		}
		return f()
	}
	if b.State == domain.StateStopped {
		done := phase(ph.Booting)
		_, err := h.Start(ctx, boxName, 90*time.Second)
		done()
		if err != nil {
			return Result{}, err
		}
		defer h.Stop(context.WithoutCancel(ctx), boxName, 30*time.Second, false)
	}
	done := phase(ph.Saving)
	defer done()
	return create(ctx, h, st, boxName, name, ph.Copying)
}

// Create snapshots the running box into a new snapshot named name. The box is
// paused while its memory and device state are saved and is running again
// before the disk copy finishes: the backup job copies point-in-time in the
// background. The work is a step plan (see creation.plan): each step is
// timed, is a kill point of the crash tests under its own name, and is undone
// when a later one fails.
func Create(ctx context.Context, h *domain.Host, st Store, boxName, name string) (Result, error) {
	return create(ctx, h, st, boxName, name, nil)
}

func create(ctx context.Context, h *domain.Host, st Store, boxName, name string, progress func(CopyProgress)) (Result, error) {
	if err := base.ValidName(name); err != nil {
		return Result{}, err
	}
	box, dom, release, err := h.LockedLookup(ctx, boxName)
	if err != nil {
		return Result{}, err
	}
	defer release()
	if box.State != domain.StateRunning {
		return Result{}, base.Errorf(base.Busy, "box %q is %s; kvbox snapshots a running box", boxName, box.State)
	}
	unlockName, err := takeName(st, name)
	if err != nil {
		return Result{}, err
	}
	defer unlockName()
	c, err := newCreation(ctx, h, st, box, dom, name, progress)
	if err != nil {
		return Result{}, err
	}
	steps, err := c.plan().Run(ctx)
	if err != nil {
		return Result{Steps: steps}, err
	}
	if err := overlay.SyncDir(st.Dir); err != nil {
		return Result{Steps: steps}, err
	}
	c.disk.dropPrevious(ctx)
	snap, err := st.Get(name)
	return Result{Snapshot: snap, Pause: c.pause, Steps: steps, Note: c.note}, err
}

// takeName holds the name of a snapshot being made: taken by a complete
// snapshot, or by one in progress, it is refused.
func takeName(st Store, name string) (unlock func(), err error) {
	if err := os.MkdirAll(st.Dir, statedir.SharedDirMode); err != nil {
		return nil, err
	}
	unlock, err = lockName(st, name)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(st.Dir, name)); err == nil {
		unlock()
		return nil, base.Errorf(base.Exists, "snapshot %q already exists (kvbox snapshots rm %s, or pick another name)", name, name)
	}
	return unlock, nil
}

// creation is one snapshot being taken: what its steps find out and hand
// on. The memory's copy is a vmstate.Save, the disk's a diskCopy.
type creation struct {
	h    *domain.Host
	st   Store
	box  domain.Box
	dom  *libvirt.Domain
	name string
	tmp  string // the partial folder the snapshot is built in

	liveXML string        // the box's migratable domain XML
	save    *vmstate.Save // the memory's copy into the state file
	disk    *diskCopy     // the disk's point-in-time copy
	p       partial       // what Recover needs, also on disk
	mem     Memory        // where the snapshot's RAM is
	token   []byte        // the snapshot's agent token (nil until giveToken)
	note    string        // Result.Note
	guest   agent.Info    // the agent's answer as it took the token
	compat  Compat        // this host's versions
	stopped time.Time     // when the box stood still
	pause   time.Duration // until it ran again
	report  func(qmp.MigrateRAM)
}

func newCreation(ctx context.Context, h *domain.Host, st Store, box domain.Box, dom *libvirt.Domain, name string, progress func(CopyProgress)) (*creation, error) {
	q := h.QMP(dom, box.Name)
	tmp := st.partialDir(name)
	c := &creation{h: h, st: st, box: box, dom: dom, name: name, tmp: tmp,
		disk: &diskCopy{q: q, st: st, box: box, path: filepath.Join(tmp, DiskFile), bitmap: bitmapPrefix + name},
		save: &vmstate.Save{QMP: q, Dom: dom, Box: box.Name, Path: filepath.Join(tmp, StateFile), Under: st.Dir},
		mem:  Memory{File: StateFile}}
	var err error
	if c.liveXML, err = dom.GetXMLDesc(libvirt.DOMAIN_XML_MIGRATABLE); err != nil {
		return nil, fmt.Errorf("read the domain XML of %q: %w", box.Name, err)
	}
	reprobe := func(ctx context.Context) error { return h.ReprobeBalloon(ctx, box) }
	if c.save.Mode, err = vmstate.ModeOf(ctx, q, reprobe); err != nil {
		return nil, err
	}
	c.report = reporter(progress, c.save.Mode.Paused)
	c.save.OnStatus = func(s qmp.MigrateStatus) {
		if s.RAM != nil {
			step.KillPoint("live-copying")
			c.report(*s.RAM)
		}
	}
	return c, nil
}

// plan lists the steps of a snapshot. The RAM is copied while the box runs
// into the state file in mapped-ram layout, and QEMU stops the box for the
// last pass and its device state; the disk's point-in-time is taken in
// that stop, and the box runs on. Steps beside the plan are round trips
// (the agent's, libvirtd's, qemu-img's) and file work that nothing before
// the pause needs.
func (c *creation) plan() step.Plan {
	return step.Plan{
		{Name: "make-folder", Do: c.makeFolder, Undo: c.removeFolder},
		// Asked now, while the guest surely runs (a paused copy stops it):
		// the agent takes the snapshot's token and says who it is.
		{Name: "give-token", Do: c.giveToken, Beside: true},
		{Name: "read-compat", Do: c.readCompat, Beside: true},
		// The disk is read before the copy starts: the switch-over
		// inactivates it, and QEMU then writes its bitmaps into the qcow2
		// (a qemu-img reading it meanwhile may fail) and takes them off
		// the block node (the previous snapshot's would not be seen).
		{Name: "read-disk-chain", Do: c.disk.readChain, Beside: true},
		{Name: "find-disk", Do: c.disk.find, Beside: true},
		{Name: "prepare", Do: c.prepare},
		// The memory copied holds the snapshot's token, not the box's.
		{Name: "live-started", Needs: []string{"give-token", "read-disk-chain", "find-disk"}, Do: c.save.Start, Undo: c.undoSave},
		// A gated copy is held back in 100 ms windows: the folder's rest
		// is made meanwhile.
		{Name: "make-rest", Needs: []string{"read-compat", "read-disk-chain", "find-disk"}, Do: c.makeRest, Beside: true},
		{Name: "copy-memory-live", Do: c.waitCopy},
		// From here to resume the box stands still.
		{Name: "open-disk-copy", Needs: []string{"make-rest"}, Do: c.openDiskCopy, Undo: c.disk.closeTarget},
		{Name: "start-disk-copy", Do: c.disk.startBackup, Undo: c.disk.cancelBackup},
		{Name: "resume", Do: c.resume},
		{Name: "renew-token", Do: c.renewToken},
		// File work of the host's alone, which needs the memory's copy only,
		// while the disk's runs.
		{Name: "copy-disk", Do: step.Together(c.disk.copy, c.save.SetBack, c.readyState)},
		{Name: "merge", Do: c.disk.merge},
		{Name: "seal", Do: func(context.Context) error { return seal(c.h, c.tmp, c.snapshot()) }},
		{Name: "publish", Do: func(context.Context) error { return os.Rename(c.tmp, filepath.Join(c.st.Dir, c.name)) }},
	}
}

// prepare records what Recover needs before anything in QEMU changes. The
// record is written, not synced: it serves a kvbox that is killed, whose
// page cache survives it; a host that goes down takes QEMU and the
// changes it records with it, and Recover removes a folder whose record
// it cannot read.
func (c *creation) prepare(ctx context.Context) error {
	// The switch-over inactivates the disk, and the pause ends with its
	// activation: it must find the page cache of the files the box shares
	// kept.
	vmstate.KeepPageCache(ctx, c.save.QMP, c.box.Name, false)
	saved, err := c.save.Prepare(ctx)
	if err != nil {
		return err
	}
	c.p = partial{Name: c.name, Box: c.box.Name, BoxUUID: c.box.UUID, PID: os.Getpid(), Bitmap: c.disk.bitmap, Saved: saved}
	return writePartial(c.tmp, c.p)
}

// waitCopy waits for the memory's copy: QEMU stops the box itself for the
// last pass and the device state, and leaves it stopped (postmigrate), so
// the disk's point-in-time is taken at the switch-over.
func (c *creation) waitCopy(ctx context.Context) (err error) {
	c.stopped, err = c.save.Wait(ctx)
	return err
}

// undoSave takes the memory's copy back (vmstate.Save.Undo); an undo that
// failed leaves the folder's record for Recover (removeFolder).
func (c *creation) undoSave() { c.save.Undo() }

// openDiskCopy opens the disk copy's target in QEMU, on the box's block
// nodes activated again after the switch-over.
func (c *creation) openDiskCopy(ctx context.Context) error {
	if err := c.save.ActivateDisks(ctx); err != nil {
		return err
	}
	return c.disk.openTarget(ctx)
}

// resume runs the box again: the end of the pause.
func (c *creation) resume(ctx context.Context) error {
	err := c.save.Continue(ctx)
	c.pause = time.Since(c.stopped)
	return err
}

// readyState readies the state file for clones to map (vmstate.
// PrepareMapped): the RAM's offset, the file synced.
func (c *creation) readyState(context.Context) (err error) {
	c.mem.Offset, err = vmstate.PrepareMapped(c.save.Path, c.box.MemoryBytes)
	return err
}

// readCompat reads this host's versions, which the snapshot records.
func (c *creation) readCompat(context.Context) (err error) {
	c.compat, err = CompatOf(c.h.Conn(), c.liveXML)
	return err
}

// makeRest makes the rest of the folder: the disk copy's target, the
// domain XML, the agent's token, what a restore needs. None of it is
// needed before the switch-over, so it is made while the memory is copied.
func (c *creation) makeRest(ctx context.Context) error {
	if err := c.disk.makeTarget(ctx); err != nil {
		return err
	}
	if err := c.h.ChownForQEMU(c.disk.path); err != nil {
		return err
	}
	if err := overlay.WriteFileAtomic(filepath.Join(c.tmp, DomainXMLFile), []byte(c.liveXML), 0o640); err != nil {
		return err
	}
	// The token of the agent in the memory, the snapshot's own: the
	// first contact of a clone.
	if err := overlay.WriteFileAtomic(filepath.Join(c.tmp, domain.AgentTokenFile), c.token, 0o600); err != nil {
		return err
	}
	cp := c.compat
	cp.Agent = c.guest.Version
	return writeCompat(c.tmp, cp)
}

// giveToken gives the box's agent the snapshot's token (domain.Host.
// GiveSnapshotToken): the token frozen into the snapshot's memory is one
// minted for it, never the box's own, which stays on this host. The
// agent's answer holds the guest's boot_id, which a clone's agent must
// answer with too, and its version. An agent that cannot be reached fails
// the snapshot: its memory would keep the box's own token.
func (c *creation) giveToken(ctx context.Context) error {
	actx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	a, err := c.h.Dial(actx, c.box)
	for errors.Is(err, base.ErrBusy) && actx.Err() == nil {
		// Other kvbox commands hold every agent port: one frees soon.
		time.Sleep(100 * time.Millisecond)
		a, err = c.h.Dial(actx, c.box)
	}
	if err != nil {
		return fmt.Errorf("box %q: its agent must take the snapshot's token before its memory is copied: %w", c.box.Name, err)
	}
	defer a.Close()
	tok, info, err := c.h.GiveSnapshotToken(actx, a, c.box)
	if err != nil {
		return err
	}
	c.token, c.guest = tok, info
	return nil
}

// renewToken gives the box's agent a token of its own again, minted after
// the snapshot's memory was copied: the token in the snapshot is no box's.
// An agent that does not take it fails nothing: the snapshot is whole, and
// the box, whose agent kvbox knows holds the snapshot's token
// (agent.token.snapshot), gets a new one at its next contact. The note
// says so.
func (c *creation) renewToken(ctx context.Context) error {
	actx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := c.h.RenewAgentToken(actx, c.box); err != nil {
		c.note = fmt.Sprintf("box %s keeps the snapshot's agent token until kvbox next reaches its agent, which then gets one of its own: %v", c.box.Name, err)
	}
	return nil
}

// reporter tells progress (nil: nobody) how far a live copy is, at most
// every 100 ms.
func reporter(progress func(CopyProgress), paused bool) func(qmp.MigrateRAM) {
	var last time.Time
	return func(r qmp.MigrateRAM) {
		if progress == nil || time.Since(last) < 100*time.Millisecond {
			return
		}
		last = time.Now()
		n := func(x json.Number) int64 { v, _ := x.Int64(); return v }
		progress(CopyProgress{Written: n(r.Normal) * 4096, Scanned: n(r.Total) - n(r.Remaining), RAM: n(r.Total), Paused: paused})
	}
}

// snapshot is the metadata of the snapshot being built.
func (c *creation) snapshot() Snapshot {
	base := c.disk.base()
	return Snapshot{
		Name: c.name, Box: c.box.Name, BoxUUID: c.box.UUID, Created: time.Now().UTC(), Image: c.box.Image,
		BaseDisk: base.Filename, BaseFormat: base.Format, Parent: c.box.Snapshot, GuestBootID: c.guest.BootID, Memory: c.mem,
		CPUs: c.box.CPUs, MemoryBytes: c.box.MemoryBytes, DiskBytes: c.box.DiskBytes, Bitmap: c.p.Bitmap,
		Incremental: c.disk.prev != nil, DiskCopiedBytes: c.disk.copied, PauseMillis: c.pause.Milliseconds(),
	}
}
