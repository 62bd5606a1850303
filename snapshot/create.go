package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
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

// liveCaps are the migration capabilities of a live memory copy: the RAM
// goes into the state file at fixed offsets (mapped-ram; x-ignore-shared
// off, so the RAM file of a box an earlier kvbox defined is copied too),
// with no stop before the
// switch-over (kvbox takes the disk's point in time once QEMU has stopped
// the guest and completed).
//
// Not multifd: with two multifd channels the copy of the Debian box with
// 1.5 GB touched took 8.2 s instead of 15.0 s here, but QEMU 10.0.2 crashes
// when such a copy is cancelled ("failed to save SaveStateEntry ... (ram):
// -5", then reason=crashed): in 1 of 3 runs of TestLiveSnapshotOfBusyBox
// (kvbox killed just after the copy started, the next command cancelling
// it), and by hand in 2 of 10 cancels sent once the copy was active and
// writing. A killed kvbox must never cost the box; the migration thread
// alone never crashed.
func liveCaps() map[string]bool {
	return map[string]bool{qmp.CapIgnoreShared: false, qmp.CapMappedRAM: true, qmp.CapMultifd: false, qmp.CapPauseBeforeSwitchover: false}
}

// liveParams are the migration parameters of a live memory copy: QEMU's
// default max-bandwidth (128 MiB/s) makes a 1.5 GB copy take 12 s; at
// 10 GiB/s it is bounded by the disk and the guest (DESIGN.md). QEMU stops
// the guest for the last pass once it expects it to take downtime-limit:
// its default, 300 ms, gave a 256 ms downtime (43 MB) on the Debian box;
// kvbox asks for 50 ms, and gives a guest that keeps dirtying faster more
// (liveWatch).
// Zero pages are checked for, and left out of the state file ("legacy":
// QEMU's own check, which its default "multifd" means without multifd);
// the hint gate turns that off while it holds the copy (gateParams).
var liveParams = map[string]any{qmp.ParamMaxBandwidth: int64(10 << 30), qmp.ParamDowntimeLimit: int64(liveDowntimes[0]), qmp.ParamZeroPageDetect: "legacy"}

// copyMode says how a box's RAM is copied: paused throughout (see
// copyPaused), or live; live and gated, starting held at the hint gate
// (see gateParams), where the box's RAM is mapped from a file (a clone, a
// box woken from sleep) and its guest takes free page hints. A clone's
// balloon offers them where its source's did not (offerFreePageHints):
// its guest's driver is asked to take its device again (the agent's
// ReprobeBalloon) so that it agrees to them. The gate is best effort: a
// QEMU that cannot say, or a guest that does not take hints, gets none.
func copyMode(ctx context.Context, q *qmp.Client, h *domain.Host, box domain.Box) (paused, gated bool, err error) {
	if paused, err = copyPaused(ctx, q); err != nil || paused {
		return paused, false, err
	}
	if t, err := q.ObjectType(ctx, "/objects/"+domain.RAMBackendID); err != nil || t == anonRAM {
		return false, false, nil
	}
	hints, _ := q.FreePageHints(ctx)
	if hints.Offered && !hints.Taken && reprobeBalloon(ctx, h, box) == nil {
		hints, _ = q.FreePageHints(ctx)
	}
	return false, hints.Taken, nil
}

// reprobeBalloon asks the box's agent to have the guest's balloon driver
// take its device again (agent.FeatureReprobeBalloon).
func reprobeBalloon(ctx context.Context, h *domain.Host, box domain.Box) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	a, err := h.Dial(ctx, box)
	if err != nil {
		return err
	}
	defer a.Close()
	// Asked without a ping first: an agent older than the request answers
	// that it does not know it, and the copy goes without hints.
	return a.ReprobeBalloon(ctx)
}

// anonRAM is the QOM type of a box's RAM when it is anonymous memory
// (domain.RAMArgs): a page the guest never touched reads as the kernel's
// zero page, which costs the host nothing, so its copy is not held back.
// A hint gate costs a copy a 100 ms window of QEMU's rate limit (see
// gateParams): the tiny box's snapshot copied its RAM in 155-176 ms
// without it, 241-281 with it, the same 76 MB written, and QEMU's
// resident memory the same.
const anonRAM = "memory-backend-ram"

// partialDir is where a snapshot is built before it is renamed into place.
func (st Store) partialDir(name string) string { return filepath.Join(st.Dir, "."+name+".partial") }

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
	Paused                bool // the box stands still while it is copied (see copyPaused)
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
	box, dom, release, err := h.LockedLookup(boxName)
	if err != nil {
		return Result{}, err
	}
	defer release()
	if box.State != domain.StateRunning {
		return Result{}, base.Errorf(base.Busy, "box %q is %s; kvbox snapshots a running box", boxName, box.State)
	}
	if err := os.MkdirAll(st.Dir, statedir.SharedDirMode); err != nil {
		return Result{}, err
	}
	// The name is taken by a complete snapshot, or by one in progress.
	unlockName, err := lockName(st, name)
	if err != nil {
		return Result{}, err
	}
	defer unlockName()
	if _, err := os.Stat(filepath.Join(st.Dir, name)); err == nil {
		return Result{}, base.Errorf(base.Exists, "snapshot %q already exists (kvbox snapshots rm %s, or pick another name)", name, name)
	}
	c := &creation{h: h, st: st, box: box, dom: dom, q: h.QMP(dom, box.Name), name: name, tmp: st.partialDir(name), progress: progress}
	if c.liveXML, err = dom.GetXMLDesc(libvirt.DOMAIN_XML_MIGRATABLE); err != nil {
		return Result{}, fmt.Errorf("read the domain XML of %q: %w", boxName, err)
	}
	if c.copyPaused, c.gated, err = copyMode(ctx, c.q, c.h, c.box); err != nil {
		return Result{}, err
	}
	steps, err := c.plan(ctx).Run(ctx)
	if err != nil {
		return Result{Steps: steps}, err
	}
	if err := overlay.SyncDir(st.Dir); err != nil {
		return Result{Steps: steps}, err
	}
	// The previous snapshot's bitmap is spent: the new one tracks changes
	// from here on.
	if c.prev != nil {
		c.q.BlockDirtyBitmapRemove(ctx, c.top, c.prev.Bitmap)
	}
	snap, err := st.Get(name)
	return Result{Snapshot: snap, Pause: c.pause, Steps: steps, Note: c.note}, err
}

// creation is one snapshot being taken: what its steps find out and hand on.
type creation struct {
	h    *domain.Host
	st   Store
	box  domain.Box
	dom  *libvirt.Domain
	q    *qmp.Client
	name string
	tmp  string // the partial folder the snapshot is built in

	top     string              // the box disk's top block node
	chain   []overlay.ImageInfo // the box disk's backing chain, top first
	prev    *Snapshot           // what an incremental disk copy builds on
	liveXML string              // the box's migratable domain XML
	p       partial             // what Recover needs, also on disk
	backing string              // what the disk copy's target sits on
	disk    string              // the disk copy's target
	mem     Memory

	paused     time.Time // when the box stood still
	running    bool      // resumed (by the plan or an undo)
	active     bool      // the disk's nodes were activated after the copy (openTarget)
	pause      time.Duration
	copyPaused bool                       // the box stays paused while its RAM is copied (see copyPaused)
	gated      bool                       // the copy starts held while the guest names its free pages (gateParams)
	bootID     string                     // the guest's boot_id, from its agent (best effort)
	guest      func() (agent.Info, error) // the agent's answer and the snapshot's token being given (prepare)
	token      []byte                     // the snapshot's agent token (nil: an agent without tokens)
	note       string                     // Result.Note
	compat     func() (Compat, error)     // the host's versions being read (prepare)
	rest       func() (string, error)     // the folder's rest being made (makeRest), the boot_id
	copied     int64                      // bytes the disk copy wrote

	progress func(CopyProgress) // the caller's, or nil
	reported time.Time          // when progress was last called
}

// plan lists the steps of a snapshot. The RAM is copied while the box runs
// into the state file in mapped-ram layout, and QEMU stops the box for the
// last pass and its device state; the disk's point-in-time is taken in
// that stop, and the box runs on.
func (c *creation) plan(ctx context.Context) step.Plan {
	return step.Plan{
		{Name: "make-folder", Do: c.makeFolder, Undo: c.removeFolder},
		{Name: "prepare", Do: c.prepare},
		{Name: "copy-memory-live", Do: c.copyLive, Undo: c.undoLive},
		{Name: "open-disk-copy", Do: c.openTarget, Undo: func() { c.q.BlockdevDel(context.WithoutCancel(ctx), targetNode) }},
		{Name: "start-disk-copy", Do: c.startBackup, Undo: func() { c.cancelBackup(context.WithoutCancel(ctx)) }},
		{Name: "resume", Do: c.resumeRunning},
		{Name: "renew-token", Do: c.renewToken},
		{Name: "copy-disk", Do: c.copyDisk},
		{Name: "merge", Do: c.merge},
		{Name: "seal", Do: func(context.Context) error { return seal(c.h, c.tmp, c.snapshot()) }},
		{Name: "publish", Do: func(context.Context) error { return os.Rename(c.tmp, filepath.Join(c.st.Dir, c.name)) }},
	}
}

// copyPaused: on TCG (QEMU emulating the CPU, no KVM) with kvbox's RAM
// not QEMU's first RAM block, the "live" copy runs with the box paused
// from before the migration starts until it is done, so it is a paused
// copy in mapped-ram layout, as long as reading the RAM once takes. QEMU's
// TCG then loses guest writes during a live migration of kvbox's RAM:
// after each dirty-bitmap sync QEMU re-arms the vCPUs' write tracking for
// the RAM block at ram_addr 0 instead of the block it synced (QEMU 10.0
// migration/ram.c, physical_memory_sync_dirty_bitmap passes the
// block-relative start to cpu_physical_memory_dirty_bits_cleared), and
// libvirt's own unused "pc.ram" backend sits at 0, kvbox.ram after it
// (HMP info ramblock). TLB entries that allow direct writes then stay
// until a guest CR3 write flushes them, and what the guest writes through
// them after its page was copied never reaches the snapshot: a guest
// writing 64 MB in a loop gave clones that panicked in hrtimer code and
// rebooted, an idle one now and then a clone that lost a process. With
// kvbox.ram first (the emulator wrapper on TCG hosts, domain/emulator.go)
// the block-relative and absolute starts are the same and the copy is
// live, as on KVM, which tracks writes in the kernel.
func copyPaused(ctx context.Context, q *qmp.Client) (bool, error) {
	kvm, err := q.KVMEnabled(ctx)
	if err != nil || kvm {
		return false, err
	}
	off, ok, err := q.RAMBlockOffset(ctx, domain.RAMBackendID)
	if err != nil {
		return false, err
	}
	return !ok || off != 0, nil
}

// removeFolder is the last undo. Once the steps' own undos have run, it
// puts the box back as Recover would (idempotent: no migration or backup
// left, capabilities and parameters as they were, running if kvbox paused
// it) and only then removes the partial folder. When QEMU or libvirt does
// not answer (libvirtd restarting), the folder and its record stay, and the
// next kvbox command's Recover finishes the job.
func (c *creation) removeFolder() {
	c.restReady()      // nothing may be made in the folder once it is gone
	if c.p.Box != "" { // the record is written: QEMU may have been changed
		if err := undoOnBox(context.Background(), c.h, c.p); err != nil {
			return
		}
	}
	os.RemoveAll(c.tmp)
	if c.guest != nil {
		// The box's agent may have the snapshot's token, which no
		// snapshot keeps now: the box, running again, gets one of its
		// own (or at its next contact, if it does not answer).
		if _, err := c.guest(); err == nil {
			c.renewToken(context.Background())
		}
	}
}

// makeFolder makes the partial folder, root's: QEMU's group traverses it
// to write the two files kvbox makes for it, the state (here, empty, until
// QEMU's migration fills it) and the disk copy (at prepare), and QEMU's
// user can put nothing else in it, so no name kvbox opens there can be a
// link planted by a QEMU that the box took over.
func (c *creation) makeFolder(context.Context) error {
	os.RemoveAll(c.tmp) // ours: we hold the name lock
	if err := os.Mkdir(c.tmp, 0o750); err != nil {
		return err
	}
	// setgid: what kvbox makes in it is QEMU's group (the snapshot's files
	// stay readable to QEMU through it; anything else has no world bits).
	err := c.h.ShareWithQEMU(c.tmp, statedir.SharedDirMode|os.ModeSetgid)
	if err == nil {
		err = makeForQEMU(c.h, filepath.Join(c.tmp, StateFile))
	}
	if err != nil {
		os.RemoveAll(c.tmp)
	}
	return err
}

// makeForQEMU creates an empty file that QEMU's user will write.
func makeForQEMU(h *domain.Host, path string) error {
	f, err := createNew(path)
	if err != nil {
		return err
	}
	f.Close()
	return h.ChownForQEMU(path)
}

// createNew creates a file of the partial folder, which must not exist yet
// (O_EXCL: nothing in its place is written through).
func createNew(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o640)
}

// prepare records what Recover needs before anything in QEMU changes. The
// record is written, not synced: it serves a kvbox that is killed, whose
// page cache survives it; a host that goes down takes QEMU and the
// changes it records with it, and Recover removes a folder whose record
// it cannot read.
func (c *creation) prepare(ctx context.Context) (err error) {
	// The agent's answer and the host's versions are asked for meanwhile:
	// each is a round trip of its own (a guest's, libvirtd's). The agent
	// gets the snapshot's token in the same round trip, which the copy of
	// the memory waits for (copyLive); only the folder's rest needs the
	// rest (makeRest). The guest is asked now, while it surely runs: a
	// paused copy (copyPaused) stops it next.
	c.guest = meanwhile(func() (agent.Info, error) { return c.giveToken(ctx) })
	c.compat = meanwhile(func() (Compat, error) { return CompatOf(c.h.Conn(), c.liveXML) })
	// The switch-over inactivates the disk, and the pause ends with its
	// activation: it must find the page cache of the files the box shares
	// kept.
	vmstate.KeepPageCache(ctx, c.q, c.box.Name, false)
	saved, err := c.q.QueryMigrateCapabilities(ctx)
	if err != nil {
		return err
	}
	c.p = partial{Name: c.name, Box: c.box.Name, BoxUUID: c.box.UUID, PID: os.Getpid(), Caps: map[string]bool{},
		Bitmap: bitmapPrefix + c.name, Paused: true}
	for k := range liveCaps() {
		c.p.Caps[k] = saved[k]
	}
	cur, err := c.q.QueryMigrateParameters(ctx)
	if err != nil {
		return err
	}
	c.p.Params = map[string]any{}
	for k := range liveParams {
		v, ok := cur[k]
		if !ok {
			return fmt.Errorf("QEMU does not report migration parameter %q; kvbox could not set it back", k)
		}
		c.p.Params[k] = v
	}
	b, err := json.Marshal(c.p)
	if err != nil {
		return err
	}
	f, err := createNew(filepath.Join(c.tmp, partialFile))
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// makeRest finds what the snapshot builds on and makes the rest of the
// folder: the disk copy's target, the domain XML, the agent's token, what
// a restore needs. None of it is needed before the switch-over, so it is
// done while the memory is copied (copyLive); openTarget waits for it, and
// so does an undo, before the folder goes. It returns the guest's boot_id.
func (c *creation) makeRest(ctx context.Context) (string, error) {
	chain := meanwhile(func() ([]overlay.ImageInfo, error) {
		return overlay.InfoChain(ctx, c.box.Disk())
	})
	var err error
	if c.top, err = c.q.TopNode(ctx, diskDevice); err != nil {
		return "", fmt.Errorf("find the disk of box %q: %w", c.box.Name, err)
	}
	if c.prev, err = previous(ctx, c.q, c.st, c.top, c.box); err != nil {
		return "", err
	}
	if c.chain, err = chain(); err != nil {
		return "", err
	}
	if len(c.chain) < 2 {
		return "", fmt.Errorf("the disk of box %q has no base image", c.box.Name)
	}
	c.disk = filepath.Join(c.tmp, DiskFile)
	if err := c.makeTarget(ctx); err != nil {
		return "", err
	}
	if err := c.h.ChownForQEMU(c.disk); err != nil {
		return "", err
	}
	if err := overlay.WriteFileAtomic(filepath.Join(c.tmp, DomainXMLFile), []byte(c.liveXML), 0o640); err != nil {
		return "", err
	}
	// The token of the agent in the memory, the snapshot's own: the
	// first contact of a clone.
	if c.token != nil {
		if err := overlay.WriteFileAtomic(filepath.Join(c.tmp, domain.AgentTokenFile), c.token, 0o600); err != nil {
			return "", err
		}
	}
	cp, err := c.compat()
	if err != nil {
		return "", err
	}
	info, _ := c.guest()
	cp.Agent = info.Version
	return info.BootID, writeCompat(c.tmp, cp)
}

// makeTarget makes the disk copy's target, a qcow2 of the source disk's
// size that stands alone above the base image once the copied blocks are
// in. The copy writes the blocks that changed since what the target sits
// on: the previous snapshot's disk for an incremental copy, else what the
// box disk sits on (its image, or for a clone its snapshot's disk). A
// snapshot's disk stands alone above the base, so a target over one
// starts as a copy of it, made now, and needs no merge afterwards.
func (c *creation) makeTarget(ctx context.Context) error {
	c.backing = c.chain[1].Filename
	format := c.chain[1].Format
	if c.prev != nil {
		c.backing, format = c.prev.Path(DiskFile), "qcow2"
	}
	base := c.base()
	if c.backing != base.Filename && format == "qcow2" {
		on, err := overlay.BackingFile(c.backing)
		if err != nil {
			return err
		}
		if on == base.Filename {
			return c.startFromStandalone(ctx, base)
		}
	}
	// Over the base, or over what is not one of kvbox's standalone
	// snapshot disks (merged after the copy).
	return overlay.CreateLarger(ctx, c.disk, c.backing, format, c.chain[0].VirtualSize)
}

// startFromStandalone makes the target a copy of the standalone snapshot
// disk it would sit on (c.backing, itself over base), of the source disk's
// size at least.
func (c *creation) startFromStandalone(ctx context.Context, base overlay.ImageInfo) error {
	if _, err := overlay.CopySparse(c.disk, c.backing); err != nil {
		return fmt.Errorf("start the snapshot disk from %s: %w", c.backing, err)
	}
	if err := os.Chmod(c.disk, 0o640); err != nil { // a sealed disk is read-only
		return err
	}
	c.backing = base.Filename
	size, err := overlay.VirtualSize(c.disk)
	if err != nil {
		return err
	}
	if size < c.chain[0].VirtualSize {
		return overlay.Resize(ctx, c.disk, c.chain[0].VirtualSize)
	}
	return nil
}

// restReady waits for the part of the folder made while the memory is
// copied (makeRest); it records the guest's boot_id.
func (c *creation) restReady() (err error) {
	if c.rest != nil {
		c.bootID, err = c.rest()
	}
	return err
}

// meanwhile runs f in a goroutine of its own; the function it returns
// waits for f's result (as often as it is called).
func meanwhile[T any](f func() (T, error)) func() (T, error) {
	done := make(chan struct{})
	var v T
	var err error
	go func() {
		defer close(done)
		v, err = f()
	}()
	return func() (T, error) {
		<-done
		return v, err
	}
}

// giveToken gives the box's agent the snapshot's token (domain.Host.
// GiveSnapshotToken): the token frozen into the snapshot's memory is one
// minted for it, never the box's own, which stays on this host. It returns
// the agent's answer, with the guest's boot_id, which a clone's agent must
// answer with too, and its version. An agent that cannot be reached fails
// the snapshot: its memory would keep the box's own token.
func (c *creation) giveToken(ctx context.Context) (agent.Info, error) {
	actx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	a, err := c.h.Dial(actx, c.box)
	for errors.Is(err, base.ErrBusy) && actx.Err() == nil {
		// Other kvbox commands hold every agent port: one frees soon.
		time.Sleep(100 * time.Millisecond)
		a, err = c.h.Dial(actx, c.box)
	}
	if err != nil {
		return agent.Info{}, fmt.Errorf("box %q: its agent must take the snapshot's token before its memory is copied: %w", c.box.Name, err)
	}
	defer a.Close()
	tok, info, err := c.h.GiveSnapshotToken(actx, a, c.box)
	if err != nil {
		return info, err
	}
	c.token = tok
	return info, nil
}

// renewToken gives the box's agent a token of its own again, minted after
// the snapshot's memory was copied: the token in the snapshot is no box's.
// An agent that does not take it fails nothing: the snapshot is whole, and
// the box, whose agent kvbox knows holds the snapshot's token
// (agent.token.snapshot), gets a new one at its next contact. The note
// says so.
func (c *creation) renewToken(ctx context.Context) error {
	if c.token == nil {
		return nil
	}
	actx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := c.h.RenewAgentToken(actx, c.box); err != nil {
		c.note = fmt.Sprintf("box %s keeps the snapshot's agent token until kvbox next reaches its agent, which then gets one of its own: %v", c.box.Name, err)
	}
	return nil
}

// writeCompat writes what a restore of the snapshot in dir needs, with
// this host's versions today and the version of the agent in the box, so
// a later upgrade of this host (or a pull on another) checks against the
// QEMU that wrote the state, not against whatever runs then.
func writeCompat(dir string, compat Compat) error {
	b, err := json.Marshal(compat)
	if err != nil {
		return err
	}
	return overlay.WriteFileAtomic(filepath.Join(dir, CompatFile), b, 0o640)
}

// suspend pauses the box: from here to resume is time it stands still.
func (c *creation) suspend(context.Context) error {
	c.paused = time.Now()
	if err := c.dom.Suspend(); err != nil {
		return fmt.Errorf("pause box %q: %w", c.box.Name, err)
	}
	return nil
}

// resume runs the box again, once, whoever stopped it (kvbox, or QEMU at a
// live copy's switch-over).
func (c *creation) resume() {
	if c.running {
		return
	}
	c.running = true
	// After an outgoing migration QEMU's block nodes are inactive; cont
	// needs them active. openTarget activated them already, unless it
	// did not get that far.
	if !c.active {
		c.q.BlockdevSetActive(context.Background(), "", true)
	}
	c.dom.Resume()
}

// setBackMigration sets the migration parameters and capabilities back as
// they were: both are tried, and what failed is said.
func (c *creation) setBackMigration(ctx context.Context) error {
	var errs []error
	if c.p.Params != nil {
		errs = append(errs, c.q.MigrateSetParameters(ctx, c.p.Params))
	}
	errs = append(errs, c.q.MigrateSetCapabilities(ctx, c.p.Caps))
	return errors.Join(errs...)
}

// copyLive copies the box's RAM while it runs: precopy into the mapped-ram
// file, QEMU's dirty tracking re-sending what the guest writes meanwhile.
// QEMU stops the box itself for the last pass and the device state, and
// leaves it stopped (postmigrate), so the disk's point-in-time is taken at
// the switch-over.
func (c *creation) copyLive(ctx context.Context) (err error) {
	defer func() {
		if err != nil {
			c.undoLive()
		}
	}()
	c.mem = Memory{File: StateFile, MappedRAM: true}
	// The memory copied holds the snapshot's token, not the box's.
	if _, err := c.guest(); err != nil {
		return err
	}
	if err := c.q.MigrateSetCapabilities(ctx, liveCaps()); err != nil {
		return err
	}
	if err := c.q.MigrateSetParameters(ctx, startParams(c.gated)); err != nil {
		return err
	}
	if c.copyPaused {
		// Paused throughout: see copyPaused.
		if err := c.suspend(ctx); err != nil {
			return err
		}
	}
	if err := c.q.Migrate(ctx, "file:"+filepath.Join(c.tmp, StateFile)); err != nil {
		return err
	}
	step.KillPoint("live-started")
	// QEMU holds a gated copy back in 100 ms windows (max-bandwidth is
	// applied per window, and a new limit does not wake it): what the
	// snapshot builds on is found, and the folder's rest made, meanwhile.
	c.rest = meanwhile(func() (string, error) { return c.makeRest(ctx) })
	stopped, err := waitLiveCopy(ctx, c.q, filepath.Join(c.tmp, StateFile), c.gated, func(s qmp.MigrateStatus) {
		if s.RAM != nil {
			step.KillPoint("live-copying")
			c.report(*s.RAM)
		}
	})
	if err != nil {
		return saveError(c.box.Name, c.st.Dir, err)
	}
	if !c.copyPaused {
		c.paused = stopped
	}
	return nil
}

// saveError words a failed copy of a box's state into dir. QEMU reports a
// full filesystem in its own words ("Unable to write to file: No space left
// on device"): kvbox says which filesystem, and the error is ENOSPC.
func saveError(box, dir string, err error) error {
	if strings.Contains(err.Error(), "No space left on device") {
		return fmt.Errorf("save the state of box %q under %s: %w", box, dir, syscall.ENOSPC)
	}
	return fmt.Errorf("save the state of box %q: %w", box, err)
}

// report tells the caller how far the live copy is, at most every 100 ms.
func (c *creation) report(r qmp.MigrateRAM) {
	if c.progress == nil || time.Since(c.reported) < 100*time.Millisecond {
		return
	}
	c.reported = time.Now()
	n := func(x json.Number) int64 { v, _ := x.Int64(); return v }
	c.progress(CopyProgress{Written: n(r.Normal) * 4096, Scanned: n(r.Total) - n(r.Remaining), RAM: n(r.Total), Paused: c.copyPaused})
}

// undoLive takes a live copy back: no migration left running, the box
// running again (QEMU may have stopped it), the migration settings as they
// were.
func (c *creation) undoLive() {
	bg := context.Background()
	c.q.CancelRunningMigration(bg)
	c.resume()
	c.setBackMigration(bg) // as far as QEMU lets it
}

// openTarget opens the disk copy's target in QEMU.
func (c *creation) openTarget(ctx context.Context) error {
	if err := c.restReady(); err != nil {
		return err
	}
	if err := c.q.BlockdevSetActive(ctx, "", true); err != nil {
		return err
	}
	c.active = true
	if err := c.q.BlockdevAdd(ctx, map[string]any{
		"driver": "qcow2", "node-name": targetNode, "backing": nil,
		"file": map[string]any{"driver": "file", "filename": c.disk},
	}); err != nil {
		return fmt.Errorf("open the snapshot disk: %w", err)
	}
	return nil
}

// startBackup starts the point-in-time disk copy (only the blocks changed
// since the previous snapshot when there is one) and, in the same
// transaction, the bitmap that tracks changes for the next snapshot.
func (c *creation) startBackup(ctx context.Context) error {
	backup := qmp.BackupArgs{JobID: backupJob, Device: c.top, Target: targetNode, Sync: qmp.SyncTop, AutoDismiss: qmp.Bool(false), Speed: heldBackupSpeed}
	if c.prev != nil {
		backup.Sync, backup.Bitmap, backup.BitmapMode = "bitmap", c.prev.Bitmap, qmp.BitmapNever
	}
	if err := c.q.Transaction(ctx,
		qmp.BitmapAddAction(qmp.BitmapAddArgs{Node: c.top, Name: c.p.Bitmap, Persistent: true}),
		qmp.BackupAction(backup),
	); err != nil {
		return fmt.Errorf("start the disk copy: %w", err)
	}
	return nil
}

func (c *creation) cancelBackup(ctx context.Context) {
	c.q.JobCancel(ctx, backupJob)
	c.q.WaitJob(ctx, backupJob, 10*time.Millisecond)
	c.q.BlockDirtyBitmapRemove(ctx, c.top, c.p.Bitmap)
}

// heldBackupSpeed is the disk copy's rate limit (bytes per second) from its
// start in the pause until the box runs again (copyDisk lifts it). The
// point-in-time is the copy-before-write filter's, taken by the
// transaction; the copying itself runs in QEMU's main loop, where the
// box's resume is served too. Unheld, a box that had written 1 GB to its
// disk before its snapshot stood still 417-460 ms, 254-284 of them in the
// resume, which waited behind the copy's first reads and writes.
const heldBackupSpeed = 1

// resumeRunning runs the box again: the end of the pause.
func (c *creation) resumeRunning(context.Context) error {
	c.resume()
	c.pause = time.Since(c.paused)
	return nil
}

// releaseBackup lifts the backup job's rate limit. A job that copied all
// within its held start (few blocks changed) may be past running already,
// and QEMU refuses a new limit then: it is done, and WaitJob finds it so.
func (c *creation) releaseBackup(ctx context.Context) error {
	err := c.q.BlockJobSetSpeed(ctx, backupJob, 0)
	if err == nil {
		return nil
	}
	if jobs, qerr := c.q.QueryJobs(ctx); qerr == nil {
		if j := qmp.FindJob(jobs, backupJob); j != nil {
			switch j.Status {
			case qmp.JobWaiting, qmp.JobPending, qmp.JobAborting, qmp.JobConcluded, qmp.JobNull:
				return nil
			}
		}
	}
	return fmt.Errorf("let the disk copy run: %w", err)
}

// copyDisk lets the backup job run (heldBackupSpeed) and waits for it: it
// copies the disk as it was at the pause (copy-before-write) while the box
// runs. Meanwhile the migration
// settings are set back (the copy is over; a failure here undoes the copy,
// which sets them back again), and the state file is readied for clones
// to map (its RAM's offset, synced): file work of the host's alone, which
// needs the memory copy only.
func (c *creation) copyDisk(ctx context.Context) error {
	if err := c.releaseBackup(ctx); err != nil {
		return err
	}
	settings := meanwhile(func() (struct{}, error) { return struct{}{}, c.setBackMigration(ctx) })
	mem := meanwhile(func() (int64, error) {
		return vmstate.PrepareMapped(filepath.Join(c.tmp, StateFile), c.box.MemoryBytes)
	})
	job, err := c.q.WaitJob(ctx, backupJob, 5*time.Millisecond)
	if err != nil {
		err = fmt.Errorf("copy the disk of box %q: %w", c.box.Name, err)
	} else {
		err = c.q.BlockdevDel(ctx, targetNode)
	}
	_, serr := settings()
	offset, merr := mem()
	if err := errors.Join(err, serr, merr); err != nil {
		return err
	}
	c.mem.Offset = offset
	c.copied = job.CurrentProgress
	return nil
}

// merge makes the snapshot stand alone: the new disk is rebased onto the
// base image, so deleting an older snapshot never breaks this one.
func (c *creation) merge(ctx context.Context) error {
	if base := c.base(); c.backing != base.Filename {
		if err := overlay.Rebase(ctx, c.disk, base.Filename, base.Format, false); err != nil {
			return fmt.Errorf("merge the snapshot disk: %w", err)
		}
	}
	return nil
}

func (c *creation) base() overlay.ImageInfo { return c.chain[len(c.chain)-1] }

// snapshot is the metadata of the snapshot being built.
func (c *creation) snapshot() Snapshot {
	base := c.base()
	return Snapshot{
		Name: c.name, Box: c.box.Name, BoxUUID: c.box.UUID, Created: time.Now().UTC(), Image: c.box.Image,
		BaseDisk: base.Filename, BaseFormat: base.Format, Parent: c.box.Snapshot, GuestBootID: c.bootID, Memory: c.mem,
		CPUs: c.box.CPUs, MemoryBytes: c.box.MemoryBytes, DiskBytes: c.box.DiskBytes, Bitmap: c.p.Bitmap,
		Incremental: c.prev != nil, DiskCopiedBytes: c.copied, PauseMillis: c.pause.Milliseconds(),
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

// seal makes a built snapshot folder durable and read-only: every file is
// synced, snapshot.json is written last, and the files belong to root again.
func seal(h *domain.Host, dir string, s Snapshot) error {
	os.Remove(filepath.Join(dir, partialFile))
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		// Never followed: a snapshot folder an older kvbox left QEMU's
		// user to write may hold what that user planted.
		p := filepath.Join(dir, e.Name())
		f, err := domain.OpenNoFollow(p, os.O_RDONLY)
		if err != nil {
			return err
		}
		err = f.Sync()
		if err == nil && e.Name() == domain.AgentTokenFile {
			// Root's only: QEMU needs it no more than anyone else.
			err = f.Chmod(0o400)
			f.Close()
			if err != nil {
				return err
			}
			continue
		}
		f.Close()
		if err != nil {
			return fmt.Errorf("sync %s: %w", p, err)
		}
		// Root's, read-only to QEMU through its group, nothing for others.
		if err := h.ShareWithQEMU(p, statedir.SharedFileMode); err != nil {
			return err
		}
	}
	if err := writeJSON(filepath.Join(dir, MetaFile), s); err != nil {
		return err
	}
	if err := h.ShareWithQEMU(filepath.Join(dir, MetaFile), statedir.SharedFileMode); err != nil {
		return err
	}
	return h.ShareWithQEMU(dir, statedir.SharedDirMode)
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
	l, err := base.Lock(filepath.Join(st.Dir, "."+name+".lock"), false)
	if errors.Is(err, base.ErrLocked) {
		return nil, base.Errorf(base.Busy, "snapshot %q is being taken by another kvbox", name)
	}
	if err != nil {
		return nil, err
	}
	return l.RemoveAndUnlock, nil
}
