package suspend

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/vmstate"
	"libvirt.org/go/libvirt"
)

// SuspendResult reports a suspend.
type SuspendResult struct {
	Pause      time.Duration // the guest stopped until its state was saved
	Total      time.Duration // the whole command, QEMU gone
	StateBytes int64         // real bytes of the saved state (and RAM copy)
	Paused     bool          // the box was paused throughout its RAM's copy (vmstate.Mode)
	Steps      step.Timings
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
	return SuspendWith(ctx, h, name, SuspendOptions{})
}

// SuspendOptions are what a suspend checks and changes besides.
type SuspendOptions struct {
	// Check, when set, is run on the box under its lock before anything
	// is done: an error refuses the suspend (a TTL's suspend checks the
	// box is the one whose deadline passed).
	Check func(domain.Box) error
	// ClearExpires takes the box's deadline away with the suspend (a TTL
	// that suspends: the box then waits, suspended, until resumed).
	ClearExpires bool
}

// SuspendWith is Suspend with o.
func SuspendWith(ctx context.Context, h *domain.Host, name string, o SuspendOptions) (SuspendResult, error) {
	t0 := time.Now()
	box, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return SuspendResult{}, err
	}
	defer release()
	if o.Check != nil {
		if err := o.Check(box); err != nil {
			return SuspendResult{}, err
		}
	}
	if box.State != domain.StateRunning {
		return SuspendResult{}, base.Errorf(base.Busy, "box %q is %s; kvbox suspends a running box", name, box.State)
	}
	s := &suspending{h: h, box: box, dom: dom, clearExpires: o.ClearExpires, stateName: fmt.Sprintf("suspend-%d.state", time.Now().UnixNano())}
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
	clearExpires bool // SuspendOptions.ClearExpires
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
	if s.clearExpires {
		meta.Expires = nil
	}
	meta.Suspended = &domain.Suspended{At: time.Now().UTC().Truncate(time.Second), State: s.stateName, PauseMillis: s.pause.Milliseconds()}
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
// its own, with its RAM backend (anonymous) a file in a folder that does
// not exist.
func suspendedXML(boot string, b domain.Box) (string, error) {
	repl := fmt.Sprintf("memory-backend-file,id=%s,size=%d,mem-path=%s,share=on", domain.RAMBackendID, b.MemoryBytes,
		domain.QemuOptEscape(filepath.Join(suspendedRAMDir(b), "memory")))
	ram := domain.RAMArgs(b.MemoryBytes)[1]
	if x, ok := domain.ReplaceQemuArg(boot, ram, repl); ok {
		return x, nil
	}
	return "", fmt.Errorf("the definition of box %q lacks kvbox's RAM backend (%s); it cannot be suspended", b.Name, ram)
}
