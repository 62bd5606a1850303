package vmstate

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/qmp"
)

// Record is what a save changes in a QEMU, as it was before: the caller
// keeps it, before Start changes anything, where a kvbox killed half-way
// leaves it for Recover.
type Record struct {
	// Caps are the migration capabilities a save sets, as they were.
	Caps map[string]bool `json:"caps"`
	// Params are the migration parameters a save sets, as they were
	// (json.Number values, set back as they are).
	Params map[string]any `json:"params"`
	// Ran says the guest ran before the save: undone, it runs again.
	Ran bool `json:"ran"`
}

// Mode is how a save copies a box's RAM.
type Mode struct {
	// Paused: the guest stands still from before the copy starts until
	// it is done (see copyPaused). Else the copy is live: QEMU stops the
	// guest for the last pass only.
	Paused bool
	// Gated: a live copy starts held while the guest names its free
	// pages (see gateParams).
	Gated bool
}

// Save is one save of a running QEMU's memory and device state into a
// file, in mapped-ram layout. Prepare records what it changes, Start
// starts the copy, Wait waits until QEMU stopped the guest and completed;
// the guest is then stopped, and what it is for is the caller's: Continue
// runs it on, or its QEMU ends. Undo takes it back, once, from any point:
// no copy left running, the guest running again, the settings as they
// were. A Start or Wait that fails has undone the save.
type Save struct {
	QMP  *qmp.Client
	Dom  Guest
	Box  string // the box's name, for messages
	Path string // the state file, made empty for QEMU's user to write
	// Under is the folder that a message about a full filesystem names
	// (the state file's own when empty).
	Under string
	Mode  Mode
	// OnStatus, when set, gets every status QEMU reports while the copy
	// runs.
	OnStatus func(qmp.MigrateStatus)
	// UndoLimit bounds Undo (zero: DefaultUndoLimit).
	UndoLimit time.Duration

	rec      *Record
	applied  bool
	paused   time.Time // when kvbox paused the guest (Mode.Paused)
	active   bool      // the disk's block nodes are active again (ActivateDisks)
	undone   bool
	undoErr  error
	guestRan bool // the guest runs again (Continue)
}

// Guest is the domain whose guest a save pauses and runs again (a
// *libvirt.Domain): through libvirt, which then knows its state.
type Guest interface {
	Suspend() error
	Resume() error
	GetState() (libvirt.DomainState, int, error)
}

// ModeOf says how the RAM of the box whose QEMU q is is copied: paused
// throughout where a live copy would lose guest writes (copyPaused); live
// and gated where the box's RAM is mapped from a file (a clone, a box
// woken from its suspend) and its guest takes free page hints. A clone's
// balloon offers them where its source's did not (RestoreXML): reprobe,
// when set, has the guest's driver take its device again (the agent's
// ReprobeBalloon) so that it agrees to them. The gate is best effort: a
// QEMU that cannot say, or a guest that does not take hints, gets none.
func ModeOf(ctx context.Context, q *qmp.Client, reprobe func(context.Context) error) (Mode, error) {
	if paused, err := copyPaused(ctx, q); err != nil || paused {
		return Mode{Paused: paused}, err
	}
	if t, err := q.ObjectType(ctx, "/objects/"+domain.RAMBackendID); err != nil || t == anonRAM {
		return Mode{}, nil
	}
	hints, _ := q.FreePageHints(ctx)
	if hints.Offered && !hints.Taken && reprobe != nil && reprobe(ctx) == nil {
		hints, _ = q.FreePageHints(ctx)
	}
	return Mode{Gated: hints.Taken}, nil
}

// anonRAM is the QOM type of a box's RAM when it is anonymous memory
// (domain.RAMArgs): a page the guest never touched reads as the kernel's
// zero page, which costs the host nothing, so its copy is not held back.
// A hint gate costs a copy a 100 ms window of QEMU's rate limit (see
// gateParams) for nothing saved there (docs/design.md#live-copy-of-ram).
const anonRAM = "memory-backend-ram"

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
// them after its page was copied never reaches the snapshot: clones of a
// busy guest crash, of an idle one now and then lose a process
// (docs/design.md#dirty-tracking-under-tcg). With
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

// liveCaps are the migration capabilities of a save: the RAM goes into
// the state file at fixed offsets (mapped-ram), with no stop before the
// switch-over (a snapshot takes the disk's point in time once QEMU has
// stopped the guest and completed).
//
// Not multifd: two multifd channels copy faster, but QEMU 10.0.2 crashes
// when such a copy is cancelled ("failed to save SaveStateEntry ... (ram):
// -5", then reason=crashed), as a killed kvbox's next command does
// (docs/design.md#live-copy-of-ram). A killed kvbox must never cost the
// box; the migration thread alone never crashed.
func liveCaps() map[string]bool {
	return map[string]bool{qmp.CapIgnoreShared: false, qmp.CapMappedRAM: true, qmp.CapMultifd: false, qmp.CapPauseBeforeSwitchover: false}
}

// liveParams are the migration parameters of a live memory copy: QEMU's
// default max-bandwidth (128 MiB/s) makes a copy of gigabytes take many
// seconds; at 10 GiB/s the disk and the guest bound it. QEMU stops the
// guest for the last pass once it expects it to take downtime-limit: its
// default, 300 ms, gives pauses near that; kvbox asks for 50 ms, and gives
// a guest that keeps dirtying faster more (liveWatch;
// docs/design.md#live-copy-of-ram).
// Zero pages are checked for, and left out of the state file ("legacy":
// QEMU's own check, which its default "multifd" means without multifd);
// the hint gate turns that off while it holds the copy (gateParams).
var liveParams = map[string]any{qmp.ParamMaxBandwidth: int64(10 << 30), qmp.ParamDowntimeLimit: int64(liveDowntimes[0]), qmp.ParamZeroPageDetect: "legacy"}

// Prepare reads what the save changes in QEMU, as it is: the caller keeps
// the Record before Start. It changes nothing.
func (s *Save) Prepare(ctx context.Context) (Record, error) {
	caps, err := s.QMP.QueryMigrateCapabilities(ctx)
	if err != nil {
		return Record{}, err
	}
	rec := Record{Caps: map[string]bool{}, Params: map[string]any{}, Ran: true}
	for k := range liveCaps() {
		v, ok := caps[k]
		if !ok {
			return Record{}, fmt.Errorf("QEMU does not know migration capability %q", k)
		}
		rec.Caps[k] = v
	}
	params, err := s.QMP.QueryMigrateParameters(ctx)
	if err != nil {
		return Record{}, err
	}
	for k := range liveParams {
		v, ok := params[k]
		if !ok {
			return Record{}, fmt.Errorf("QEMU does not report migration parameter %q; kvbox could not set it back", k)
		}
		rec.Params[k] = v
	}
	s.rec = &rec
	return rec, nil
}

// Apply sets the save's migration capabilities and parameters. They do
// not touch the running guest: set before Start, they keep QEMU round
// trips out of a paused copy.
func (s *Save) Apply(ctx context.Context) error {
	if s.rec == nil {
		return errors.New("vmstate: Apply before Prepare")
	}
	s.applied = true
	if err := s.QMP.MigrateSetCapabilities(ctx, liveCaps()); err != nil {
		return err
	}
	return s.QMP.MigrateSetParameters(ctx, startParams(s.Mode.Gated))
}

// Start starts the copy into Path (Apply first, unless done): QEMU writes
// the state file from here on. In Mode.Paused the guest is paused first.
func (s *Save) Start(ctx context.Context) (err error) {
	defer s.undoOnError(&err)
	if !s.applied {
		if err := s.Apply(ctx); err != nil {
			return err
		}
	}
	if s.Mode.Paused {
		s.paused = time.Now()
		if err := s.Dom.Suspend(); err != nil {
			return fmt.Errorf("pause box %q: %s", s.Box, domain.LibvirtMessage(err))
		}
	}
	return s.QMP.Migrate(ctx, "file:"+s.Path)
}

// Wait follows the copy (paced, see liveWatch) until QEMU completed it,
// and returns when the guest stopped: when QEMU stopped it for the last
// pass, or when kvbox paused it (Mode.Paused).
func (s *Save) Wait(ctx context.Context) (stopped time.Time, err error) {
	defer s.undoOnError(&err)
	stopped, err = waitLiveCopy(ctx, s.QMP, s.Path, s.Mode.Gated, s.OnStatus)
	if err != nil {
		return time.Time{}, s.saveError(err)
	}
	if s.Mode.Paused {
		stopped = s.paused
	}
	return stopped, nil
}

// saveError words a failed copy. QEMU reports a full filesystem in its own
// words ("Unable to write to file: No space left on device"): kvbox says
// which filesystem, and the error is ENOSPC.
func (s *Save) saveError(err error) error {
	if strings.Contains(err.Error(), "No space left on device") {
		under := s.Under
		if under == "" {
			under = filepath.Dir(s.Path)
		}
		return fmt.Errorf("save the state of box %q under %s: %w", s.Box, under, syscall.ENOSPC)
	}
	return fmt.Errorf("save the state of box %q: %w", s.Box, err)
}

func (s *Save) undoOnError(err *error) {
	if *err != nil {
		s.Undo()
	}
}

// ActivateDisks activates the box's block nodes, which the switch-over
// left inactive: for a block job before the guest runs again.
func (s *Save) ActivateDisks(ctx context.Context) error {
	if err := s.QMP.BlockdevSetActive(ctx, "", true); err != nil {
		return err
	}
	s.active = true
	return nil
}

// Continue runs the guest again after a completed save.
func (s *Save) Continue(ctx context.Context) error {
	s.guestRan = true
	return cont(ctx, s.QMP, s.Dom, s.Box, s.active)
}

// SetBack sets the migration capabilities and parameters back as they
// were: after a completed save whose QEMU runs on.
func (s *Save) SetBack(ctx context.Context) error {
	if s.rec == nil {
		return nil
	}
	return setBack(ctx, s.QMP, *s.rec)
}

// Undo takes the save back: no copy left running, the guest running
// again if it ran before, the settings as they were. It runs once; later
// calls return what the first did. An error says that QEMU may still hold
// what the save changed: the caller keeps the Record for Recover.
func (s *Save) Undo() error {
	if s.undone {
		return s.undoErr
	}
	s.undone = true
	if s.rec == nil {
		return nil // nothing was changed
	}
	rec := *s.rec
	rec.Ran = rec.Ran && !s.guestRan
	// Bounded: a migration that never leaves "cancelling" would hold the
	// kvbox that undoes it for good; the record stays for Recover.
	limit := cmp.Or(s.UndoLimit, DefaultUndoLimit)
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	s.undoErr = undo(ctx, s.QMP, s.Dom, s.Box, rec, s.active)
	return s.undoErr
}

// DefaultUndoLimit bounds an undo of a save: cancelling a copy, the
// guest's resume and the settings set back are round trips to QEMU.
const DefaultUndoLimit = time.Minute

// Recover undoes a save whose kvbox was killed half-way, from its Record:
// no copy left running, the settings as they were, the guest running
// again if it ran before and is paused now. It is Undo for a kvbox that
// knows nothing but the Record, and is idempotent.
func Recover(ctx context.Context, q *qmp.Client, dom Guest, box string, rec Record) error {
	return undo(ctx, q, dom, box, rec, false)
}

func undo(ctx context.Context, q *qmp.Client, dom Guest, box string, rec Record, active bool) error {
	// The cancel's wait gets half of a bounded undo: the guest's resume
	// and the settings still get their turn after a cancel that hangs.
	cctx := ctx
	if d, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		cctx, cancel = context.WithDeadline(ctx, time.Now().Add(time.Until(d)/2))
		defer cancel()
	}
	q.CancelRunningMigration(cctx)
	var errs []error
	if st, err := q.QueryMigrate(ctx); err == nil && qmp.MigrationRunning(st.Status) {
		errs = append(errs, fmt.Errorf("box %q: the memory's copy did not stop (QEMU says %q)", box, st.Status))
	}
	if st, _, err := dom.GetState(); err != nil {
		errs = append(errs, fmt.Errorf("box %q: %s", box, domain.LibvirtMessage(err)))
	} else if st == libvirt.DOMAIN_PAUSED && rec.Ran {
		errs = append(errs, cont(ctx, q, dom, box, active))
	}
	errs = append(errs, setBack(ctx, q, rec))
	return errors.Join(errs...)
}

// cont runs a stopped guest again. After an outgoing migration QEMU's
// block nodes are inactive and cont needs them active: they are
// activated unless they are already.
func cont(ctx context.Context, q *qmp.Client, dom Guest, box string, active bool) error {
	if !active {
		if err := q.BlockdevSetActive(ctx, "", true); err != nil {
			return err
		}
	}
	if err := dom.Resume(); err != nil {
		return fmt.Errorf("run box %q again: %s", box, domain.LibvirtMessage(err))
	}
	return nil
}

// setBack sets the migration parameters and capabilities of rec: both
// are tried, and what failed is said.
func setBack(ctx context.Context, q *qmp.Client, rec Record) error {
	var errs []error
	if len(rec.Params) > 0 {
		errs = append(errs, q.MigrateSetParameters(ctx, rec.Params))
	}
	if len(rec.Caps) > 0 {
		errs = append(errs, q.MigrateSetCapabilities(ctx, rec.Caps))
	}
	return errors.Join(errs...)
}
