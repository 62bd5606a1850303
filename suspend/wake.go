package suspend

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/vmstate"
	"libvirt.org/go/libvirt"
)

// ResumeResult reports a resume.
type ResumeResult struct {
	Box   domain.Box
	Total time.Duration
	Steps step.Timings
}

// Resume starts a suspended box from its saved state, with its own name,
// MAC and address (no re-identification; the clock is set): every process
// runs on where it stopped, and its disk is as it was. Two plans: waking
// it (on failure it stays suspended), then, once the guest runs from its
// saved state and may have written to its disk, settling it as a running
// box (never suspended again with an older state than its disk's).
func Resume(ctx context.Context, h *domain.Host, name string, agentTimeout time.Duration) (ResumeResult, error) {
	t0 := time.Now()
	box, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return ResumeResult{}, err
	}
	defer release()
	if box.State == domain.StatePMSuspended {
		// The guest put itself to sleep (ACPI S3): nothing kvbox saved.
		return ResumeResult{}, base.Errorf(base.Busy, "box %q was put to sleep by its own guest, not by kvbox suspend (kvbox resume %s wakes it)", name, name)
	}
	if box.State != domain.StateSuspended || box.Suspended == nil {
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
		{Name: "define-boot+agent", Do: step.Together(r.defineBoot, func(ctx context.Context) error { return r.setClock(ctx, agentTimeout) })},
	}
	more, err := settle.Run(ctx)
	ts = append(ts, more...)
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
// again).
func (r *resuming) wakeXML() (string, error) {
	off, err := vmstate.PrepareMapped(r.statePath, r.box.MemoryBytes)
	if err != nil {
		return "", fmt.Errorf("its saved state: %w", err)
	}
	spec := vmstate.RestoreSpec{Name: r.box.Name, Meta: r.box.Meta, Disk: r.box.Disk(), UUID: r.box.UUID, MemBytes: r.box.MemoryBytes,
		MemPath: r.statePath, MemOffset: off}
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
			if err := vmstate.Load(ctx, r.h.QMP(r.dom, name), name, r.statePath); err != nil {
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
