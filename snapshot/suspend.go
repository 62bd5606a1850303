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

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/vmstate"
)

// Suspend and resume use the live-snapshot machinery on the box itself
// instead of libvirt's managed save: managed save writes every page of the
// guest's RAM into one stream and `virsh start` reads all of it back (a
// 4 GiB box: 14.7 s and 6.8 s, DESIGN.md). kvbox copies the RAM live into
// a mapped-ram state file in the box's folder (QEMU stops the guest only
// for the last pass), and resume maps that file privately, as a clone maps
// its snapshot: a page is read from it when the guest first touches it, so
// neither the pause nor the resume grows with the RAM. The state file
// stays while the resumed box runs (its QEMU maps it, and a `virsh
// restore` of the box would map it again); the next suspend, or a cold
// start, deletes it.
//
// While suspended, the box's persistent definition's RAM backend is a file
// in a folder that does not exist (SUSPENDED-run-kvbox-resume-NAME): an
// operator's `virsh start` fails at once with that path in the error and
// changes nothing, instead of cold-booting over the saved memory or
// restoring a stale state later. kvbox ls shows the box as suspended.

// SuspendResult reports a suspend.
type SuspendResult struct {
	Pause      time.Duration // the guest stopped until its state was saved
	Total      time.Duration // the whole command, QEMU gone
	StateBytes int64         // real bytes of the saved state (and RAM copy)
	Paused     bool          // the box was paused throughout its RAM's copy (vmstate.Mode)
	Steps      step.Timings
}

// ResumeResult reports a resume.
type ResumeResult struct {
	Box   domain.Box
	Total time.Duration
	Steps step.Timings
}

// suspendedRAMDir is the folder, never created, that a suspended box's
// persistent definition maps its RAM from: `virsh start` then fails and
// says why.
func suspendedRAMDir(b domain.Box) string {
	return filepath.Join(b.Dir, "SUSPENDED-run-kvbox-resume-"+b.Name)
}

// Suspend saves a running box's memory and device state to disk and ends
// its QEMU: RAM and CPU are given back. The work is a step plan (see
// suspending.plan); on a failure before QEMU is gone, the box runs on as it
// was.
func Suspend(ctx context.Context, h *domain.Host, name string) (SuspendResult, error) {
	t0 := time.Now()
	box, dom, release, err := h.LockedLookup(name)
	if err != nil {
		return SuspendResult{}, err
	}
	defer release()
	if box.State != domain.StateRunning {
		return SuspendResult{}, base.Errorf(base.Busy, "box %q is %s; kvbox suspends a running box", name, box.State)
	}
	s := &suspending{h: h, box: box, dom: dom, stateName: fmt.Sprintf("suspend-%d.state", time.Now().UnixNano())}
	s.save = &vmstate.Save{QMP: h.QMP(dom, name), Dom: dom, Box: name, Path: filepath.Join(box.Dir, s.stateName), Under: box.Dir}
	if err := s.readDefinitions(); err != nil {
		return SuspendResult{}, err
	}
	ts, err := s.plan().Run(ctx)
	if err != nil {
		return SuspendResult{Steps: ts}, err
	}
	// QEMU is gone: the box is suspended whatever happens now, what the
	// save changed in it went with it, and the state it mapped its RAM
	// from, if it was resumed, is garbage.
	os.Remove(h.SuspendFile(name, domain.SuspendSaving))
	domain.RemoveSuspendStates(box.Dir, func(p string) bool { return p == s.save.Path })
	size, _ := overlay.Du(s.save.Path)
	return SuspendResult{Pause: s.pause, Total: time.Since(t0), StateBytes: size, Paused: s.save.Mode.Paused, Steps: ts}, nil
}

// suspending is one suspend in progress: what its steps find out and hand
// on.
type suspending struct {
	h   *domain.Host
	box domain.Box
	dom *libvirt.Domain

	live, boot   string        // the running box's migratable XML, its persistent definition
	suspendedDef string        // the definition that makes virsh start fail
	stateName    string        // the state file, in the box's folder
	save         *vmstate.Save // the memory's copy into it
	pause        time.Duration
}

// plan lists a suspend's steps: the RAM is copied live into a mapped-ram
// state file and QEMU stops the guest for the last pass and the device
// state. From define-suspended on, an operator's virsh start fails;
// end-qemu is the point of no return.
func (s *suspending) plan() step.Plan {
	return step.Plan{
		{Name: "keep-definitions", Do: s.keepDefinitions, Undo: func() { s.h.RemoveSuspendFiles(s.box.Name) }},
		// Settings first: they do not touch the running guest, and every
		// QMP round trip inside the pause lengthens it.
		{Name: "set-migration", Do: s.setMigration, Undo: s.undoSave},
		{Name: "save-live", Do: s.saveLive, Undo: s.undoSave},
		{Name: "sync-state", Do: func(context.Context) error { return overlay.SyncFile(s.save.Path) }},
		{Name: "define-suspended", Do: s.defineSuspended, Undo: s.defineBoot},
		{Name: "end-qemu", Do: func(context.Context) error { return domain.PullPlug(s.dom, s.box.Name) }},
	}
}

// readDefinitions reads what a suspend keeps and what it defines instead.
func (s *suspending) readDefinitions() (err error) {
	if s.live, err = s.dom.GetXMLDesc(libvirt.DOMAIN_XML_MIGRATABLE); err != nil {
		return fmt.Errorf("read the domain XML of %q: %s", s.box.Name, domain.LibvirtMessage(err))
	}
	if s.boot, err = s.dom.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE); err != nil {
		return fmt.Errorf("read the domain XML of %q: %s", s.box.Name, domain.LibvirtMessage(err))
	}
	s.suspendedDef, err = suspendedXML(s.boot, s.box)
	return err
}

// keepDefinitions keeps the box's running XML (what resume starts from)
// and its own definition (what it boots from afterwards).
func (s *suspending) keepDefinitions(context.Context) error {
	if err := os.MkdirAll(filepath.Dir(s.h.SuspendFile(s.box.Name, domain.SuspendLive)), 0o700); err != nil {
		return err
	}
	for k, x := range map[string]string{domain.SuspendLive: s.live, domain.SuspendBoot: s.boot} {
		if err := overlay.WriteFileAtomic(s.h.SuspendFile(s.box.Name, k), []byte(x), 0o600); err != nil {
			return err
		}
	}
	return nil
}

// setMigration picks how the RAM is copied, records what the save changes
// in QEMU where Recover finds it, and changes it.
func (s *suspending) setMigration(ctx context.Context) (err error) {
	reprobe := func(ctx context.Context) error { return s.h.ReprobeBalloon(ctx, s.box) }
	if s.save.Mode, err = vmstate.ModeOf(ctx, s.save.QMP, reprobe); err != nil {
		return err
	}
	rec, err := s.save.Prepare(ctx)
	if err != nil {
		return err
	}
	if err := writeRecord(s.h, s.box.Name, rec); err != nil {
		return err
	}
	return s.save.Apply(ctx)
}

// saveLive copies the box's RAM while it runs; QEMU stops the guest for
// the last pass and the device state. A save that fails has undone
// itself, its state file gone.
func (s *suspending) saveLive(ctx context.Context) (err error) {
	defer func() {
		if err != nil {
			os.Remove(s.save.Path)
		}
	}()
	if err := s.save.Start(ctx); err != nil {
		return err
	}
	stopped, err := s.save.Wait(ctx)
	if err != nil {
		return err
	}
	s.pause = time.Since(stopped)
	return nil
}

// undoSave takes the save back (once: vmstate.Save.Undo) and deletes its
// state file.
func (s *suspending) undoSave() {
	s.save.Undo()
	os.Remove(s.save.Path)
}

// writeRecord keeps what a suspend's save changes in QEMU, before it
// changes it, for the Recover of a suspend that was killed.
func writeRecord(h *domain.Host, name string, rec vmstate.Record) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	return overlay.WriteFileAtomic(h.SuspendFile(name, domain.SuspendSaving), b, 0o600)
}

// readRecord reads what writeRecord kept.
func readRecord(h *domain.Host, name string) (vmstate.Record, error) {
	var rec vmstate.Record
	b, err := os.ReadFile(h.SuspendFile(name, domain.SuspendSaving))
	if err != nil {
		return rec, err
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return rec, fmt.Errorf("%s: %w", h.SuspendFile(name, domain.SuspendSaving), err)
	}
	return rec, nil
}

// defineSuspended makes the box's definition the one virsh start refuses,
// before QEMU goes (from the moment QEMU is gone no start may boot over the
// saved memory), and marks the box suspended in its metadata.
func (s *suspending) defineSuspended(context.Context) error {
	if err := s.h.Define(s.suspendedDef); err != nil {
		return fmt.Errorf("define suspended box %q: %w", s.box.Name, err)
	}
	meta := s.box.Meta
	meta.Suspended = &domain.Suspended{At: time.Now().UTC().Truncate(time.Second), State: s.stateName, MappedRAM: true, PauseMillis: s.pause.Milliseconds()}
	if err := domain.WriteMeta(s.dom, meta, false); err != nil {
		s.defineBoot()
		return fmt.Errorf("mark box %q suspended: %w", s.box.Name, err)
	}
	return nil
}

// defineBoot puts the box's own definition and metadata back.
func (s *suspending) defineBoot() {
	s.h.Define(s.boot)
	domain.WriteMeta(s.dom, s.box.Meta, true)
}

// suspendedXML is the box's persistent definition while it is suspended:
// its own, with its RAM backend (anonymous, or the RAM file of a box an
// earlier kvbox defined) a file in a folder that does not exist.
func suspendedXML(boot string, b domain.Box) (string, error) {
	repl := domain.LegacyRAMArgs(b.MemoryBytes, filepath.Join(suspendedRAMDir(b), "memory"))[1]
	ram := domain.RAMArgs(b.MemoryBytes)[1]
	for _, o := range []string{ram, domain.LegacyRAMArgs(b.MemoryBytes, domain.MemoryFile(b.Dir))[1]} {
		if x, ok := domain.ReplaceQemuArg(boot, o, repl); ok {
			return x, nil
		}
	}
	return "", fmt.Errorf("the definition of box %q lacks kvbox's RAM backend (%s); it cannot be suspended", b.Name, ram)
}

// Resume starts a suspended box from its saved state, with its own name,
// MAC and address (no re-identification; the clock is set): every process
// runs on where it stopped, and its disk is as it was. Two plans: waking
// it (on failure it stays suspended), then, once the guest runs from its
// saved state and may have written to its disk, settling it as a running
// box (never suspended again with an older state than its disk's).
func Resume(ctx context.Context, h *domain.Host, name string, agentTimeout time.Duration) (ResumeResult, error) {
	t0 := time.Now()
	box, dom, release, err := h.LockedLookup(name)
	if err != nil {
		return ResumeResult{}, err
	}
	defer release()
	if box.State != domain.StateSuspended {
		return ResumeResult{}, base.Errorf(base.Busy, "box %q is %s, not suspended", name, box.State)
	}
	r := &resuming{h: h, box: box, dom: dom, saved: *box.Suspended}
	if err := r.readSaved(); err != nil {
		return ResumeResult{}, err
	}
	if err := h.EnsureBoxNetwork(box); err != nil {
		return ResumeResult{}, err
	}
	if err := h.AllowPort(box); err != nil {
		return ResumeResult{}, err
	}
	ts, err := r.wake().Run(ctx)
	if err != nil {
		return ResumeResult{Steps: ts}, err
	}
	if agentTimeout <= 0 {
		agentTimeout = 60 * time.Second
	}
	// The box's own definition goes back while its agent wakes: neither
	// waits for the other.
	settle := step.Plan{
		{Name: "define-boot+agent", Do: func(ctx context.Context) error {
			defined := make(chan error, 1)
			go func() { defined <- r.defineBoot(ctx) }()
			err := r.setClock(ctx, agentTimeout)
			return errors.Join(<-defined, err)
		}},
	}
	more, err := settle.Run(ctx)
	ts = append(ts, more...)
	if !r.saved.MappedRAM {
		os.Remove(r.statePath) // loaded: the RAM is the box's memory file
	}
	if err != nil {
		return ResumeResult{Steps: ts}, fmt.Errorf("box %q runs again from its suspend, but: %w", name, err)
	}
	res := ResumeResult{Total: time.Since(t0), Steps: ts}
	res.Box, err = h.Get(name)
	return res, err
}

// resuming is one resume in progress.
type resuming struct {
	h     *domain.Host
	box   domain.Box
	dom   *libvirt.Domain
	saved domain.Suspended

	statePath             string
	live, boot            []byte // kept by the suspend
	suspendedDef, wakeDef string // the definition now, the one QEMU starts from
}

// readSaved reads and checks what the suspend kept.
func (r *resuming) readSaved() (err error) {
	name, s := r.box.Name, r.saved
	if s.State == "" || strings.ContainsAny(s.State, "/\x00") || s.State == ".." {
		return fmt.Errorf("box %q: its metadata names no saved state file (%q)", name, s.State)
	}
	r.statePath = filepath.Join(r.box.Dir, s.State)
	if _, err := os.Stat(r.statePath); err != nil {
		return fmt.Errorf("box %q: its saved state: %w", name, err)
	}
	if r.live, err = os.ReadFile(r.h.SuspendFile(name, domain.SuspendLive)); err != nil {
		return fmt.Errorf("box %q: its saved domain XML: %w", name, err)
	}
	if r.boot, err = os.ReadFile(r.h.SuspendFile(name, domain.SuspendBoot)); err != nil {
		return fmt.Errorf("box %q: its saved domain XML: %w", name, err)
	}
	if r.suspendedDef, err = r.dom.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE); err != nil {
		return fmt.Errorf("read box %q: %s", name, domain.LibvirtMessage(err))
	}
	return nil
}

// wakeXML is the definition QEMU starts from. It keeps the suspended mark
// until the end: a kvbox killed half-way leaves a box kvbox still knows to
// be suspended (never one that kvbox start would boot afresh over its
// saved memory). The box maps its RAM privately from the state file, at
// the offset of its pages, whose bitmap is zeroed so that QEMU loads only
// the device state (both idempotent: a resume that failed can be tried
// again). A box an earlier kvbox suspended saved only its device state;
// its RAM is its memory file.
func (r *resuming) wakeXML() (string, error) {
	spec := vmstate.RestoreSpec{Name: r.box.Name, Meta: r.box.Meta, Disk: r.box.Disk(), UUID: r.box.UUID, MemBytes: r.box.MemoryBytes,
		MemPath: r.statePath}
	if r.saved.MappedRAM {
		off, err := vmstate.PrepareMapped(r.statePath, r.box.MemoryBytes)
		if err != nil {
			return "", fmt.Errorf("its saved state: %w", err)
		}
		spec.MemOffset = off
	} else {
		spec.RAMFile = domain.MemoryFile(r.box.Dir)
	}
	return vmstate.RestoreXML(string(r.live), spec)
}

// wake lists the steps that start the box from its saved state, up to the
// moment its guest runs again.
func (r *resuming) wake() step.Plan {
	name := r.box.Name
	return step.Plan{
		{Name: "define-resume", Do: func(context.Context) error {
			var err error
			if r.wakeDef, err = r.wakeXML(); err != nil {
				return fmt.Errorf("resume box %q: %w", name, err)
			}
			if err := r.h.EnsureEmulator(r.wakeDef); err != nil {
				return err
			}
			if err := r.h.Define(r.wakeDef); err != nil {
				return fmt.Errorf("define box %q to resume it: %w", name, err)
			}
			return nil
		}, Undo: func() { r.h.Define(r.suspendedDef) }},
		{Name: "start-paused", Do: func(context.Context) error {
			if err := r.dom.CreateWithFlags(libvirt.DOMAIN_START_PAUSED); err != nil {
				return fmt.Errorf("start box %q: %s", name, domain.LibvirtMessage(err))
			}
			return nil
		}, Undo: func() { domain.PullPlug(r.dom, name) }},
		{Name: "load", Do: func(ctx context.Context) error {
			if err := vmstate.Load(ctx, r.h.QMP(r.dom, name), name, r.statePath, r.saved.MappedRAM); err != nil {
				return fmt.Errorf("load the saved state of box %q: %w", name, err)
			}
			return nil
		}},
		{Name: "resume", Do: func(context.Context) error {
			if err := r.dom.Resume(); err != nil {
				return fmt.Errorf("resume box %q: %s", name, domain.LibvirtMessage(err))
			}
			return nil
		}},
	}
}

// defineBoot gives the running box its own definition back, for its next
// cold boot, with the metadata as it is now (kvbox ttl may have changed it
// while it slept).
func (r *resuming) defineBoot(context.Context) error {
	if err := r.h.Define(string(r.boot)); err != nil {
		return fmt.Errorf("define box %q for its next boot: %w", r.box.Name, err)
	}
	meta := r.box.Meta
	meta.Suspended = nil
	if err := domain.WriteMeta(r.dom, meta, true); err != nil {
		return fmt.Errorf("box %q: %w", r.box.Name, err)
	}
	r.h.RemoveSuspendFiles(r.box.Name)
	return nil
}

// setClock waits for the agent and sets the guest's clock: it slept.
func (r *resuming) setClock(ctx context.Context, timeout time.Duration) error {
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	b := r.box
	b.State, b.Suspended = domain.StateRunning, nil
	c, _, err := r.h.WaitAgent(actx, r.dom, b)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetClock(actx, time.Now()); err != nil && !errors.Is(err, errors.ErrUnsupported) {
		return fmt.Errorf("set the clock of box %q: %w", r.box.Name, err)
	}
	return nil
}

// RecoverSuspends finishes or undoes a suspend or resume whose kvbox was
// killed (every kvbox command runs it): boxes with suspend files whose lock
// nobody holds are put in a consistent state. What the guest may already
// have written to its disk decides the direction: a guest that never ran
// again from its saved state goes back to it; one that did runs on.
//   - shut off: suspended (nothing to do), or the files are debris;
//   - suspend killed before its definition: the guest runs on as it was;
//   - suspend killed after it (the state is complete): QEMU is ended;
//   - resume killed with QEMU still paused: QEMU ended, suspended again;
//   - resume killed after the guest ran: it keeps running, its own
//     definition back.
func RecoverSuspends(ctx context.Context, h *domain.Host) error {
	var errs []error
	for _, name := range h.SuspendedBoxes() {
		if err := recoverSuspend(ctx, h, name); err != nil {
			errs = append(errs, fmt.Errorf("box %q: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

func recoverSuspend(ctx context.Context, h *domain.Host, name string) error {
	l, err := h.TryLockBox(name)
	if err != nil {
		return nil // a live kvbox is at it
	}
	defer l.Unlock()
	box, dom, err := h.Lookup(name)
	if errors.Is(err, base.ErrNotFound) {
		h.RemoveSuspendFiles(name)
		return nil
	}
	if err != nil {
		return err
	}
	defer dom.Free()
	inactive, err := dom.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE)
	if err != nil {
		return fmt.Errorf("%s", domain.LibvirtMessage(err))
	}
	persistentSuspended := strings.Contains(inactive, "<suspended>") || strings.Contains(inactive, ":suspended>")
	boot, err := os.ReadFile(h.SuspendFile(name, domain.SuspendBoot))
	if err != nil {
		return err
	}
	st, _, err := dom.GetState()
	if err != nil {
		return fmt.Errorf("%s", domain.LibvirtMessage(err))
	}
	bg := context.WithoutCancel(ctx)
	if st == libvirt.DOMAIN_SHUTOFF {
		if !persistentSuspended {
			h.RemoveSuspendFiles(name) // debris: the box is stopped, not suspended
		}
		return nil
	}
	switch {
	case box.Suspended == nil && !persistentSuspended:
		// Suspend killed while saving: the guest runs on.
		return runOn(bg, h, box, dom)
	case box.Suspended == nil:
		// Suspend killed after its definition: the state is saved.
		return domain.PullPlug(dom, name)
	case st == libvirt.DOMAIN_PAUSED:
		// Resume killed before the guest ran: suspended again.
		return suspendAgain(h, box, dom, string(boot))
	default:
		// Resume killed after the guest ran: it runs on, as itself.
		return settleResumed(h, box, dom, string(boot))
	}
}

// runOn undoes a suspend killed while it saved: what the save changed in
// QEMU undone from its record (vmstate.Recover; none was written before it
// changed anything), the suspend's files gone.
func runOn(ctx context.Context, h *domain.Host, box domain.Box, dom *libvirt.Domain) error {
	rec, err := readRecord(h, box.Name)
	switch {
	case err == nil:
		if err := vmstate.Recover(ctx, h.QMP(dom, box.Name), dom, box.Name, rec); err != nil {
			return fmt.Errorf("undo an interrupted suspend: %w", err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return err
	}
	h.RemoveSuspendFiles(box.Name)
	// The state a resumed box maps its RAM from, which its domain XML
	// names, stays (nothing goes when the XML cannot be read).
	if x, err := dom.GetXMLDesc(0); err == nil {
		domain.RemoveSuspendStates(box.Dir, func(p string) bool { return strings.Contains(x, domain.QemuOptEscape(p)) })
	}
	return nil
}

// suspendAgain ends a QEMU that a killed resume started and left paused:
// the box is suspended as it was.
func suspendAgain(h *domain.Host, box domain.Box, dom *libvirt.Domain, boot string) error {
	if err := domain.PullPlug(dom, box.Name); err != nil {
		return err
	}
	sx, err := suspendedXML(boot, box)
	if err != nil {
		return err
	}
	if err := h.Define(sx); err != nil {
		return fmt.Errorf("define suspended box: %w", err)
	}
	return domain.WriteMeta(dom, box.Meta, false)
}

// settleResumed finishes a resume killed after the guest ran: its own
// definition back, the suspended mark and the saved state gone.
func settleResumed(h *domain.Host, box domain.Box, dom *libvirt.Domain, boot string) error {
	if err := h.Define(boot); err != nil {
		return fmt.Errorf("define box for its next boot: %w", err)
	}
	meta := box.Meta
	state := meta.Suspended.State
	meta.Suspended = nil
	if err := domain.WriteMeta(dom, meta, true); err != nil {
		return err
	}
	h.RemoveSuspendFiles(box.Name)
	if state != "" && !strings.ContainsAny(state, "/") && !box.Suspended.MappedRAM {
		os.Remove(filepath.Join(box.Dir, state)) // loaded: not mapped
	}
	return nil
}
