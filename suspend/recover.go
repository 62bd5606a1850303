package suspend

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/vmstate"
	"libvirt.org/go/libvirt"
)

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
// definition back and the suspended mark gone (the state file stays: the
// running box maps its RAM from it).
func settleResumed(h *domain.Host, box domain.Box, dom *libvirt.Domain, boot string) error {
	if err := h.Define(boot); err != nil {
		return fmt.Errorf("define box for its next boot: %w", err)
	}
	meta := box.Meta
	meta.Suspended = nil
	if err := domain.WriteMeta(dom, meta, true); err != nil {
		return err
	}
	h.RemoveSuspendFiles(box.Name)
	return nil
}
