package kvbox

import (
	"context"
	"fmt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
)

// HostCompat is this host's side of a snapshot's compatibility (domain
// type, arch, machine types, QEMU, agent protocol): what a scheduler
// matches snapshots against.
func (h *Host) HostCompat(ctx context.Context) (snapshot.HostCompat, error) {
	typ, err := h.d.DomainType()
	if err != nil {
		return snapshot.HostCompat{}, err
	}
	hc, err := snapshot.HostCompatOf(h.d.Conn(), typ)
	if err != nil {
		return snapshot.HostCompat{}, base.Errorf(base.Unavailable, "read this host's restore class from libvirt: %s", domain.LibvirtMessage(err))
	}
	return hc, nil
}

// CheckHostFor refuses, in one line, a snapshot this host cannot restore
// (domain type, machine type, QEMU version, CPU), before a clone starts
// and fails halfway. A snapshot it passed once (by name and creation) is
// not checked again: a front that clones it many times asks libvirt once.
func (h *Host) CheckHostFor(s snapshot.Snapshot) error {
	key := s.Name + "@" + snapshotID(s)
	h.checkedMu.Lock()
	ok := h.checked[key]
	h.checkedMu.Unlock()
	if ok {
		return nil
	}
	if err := h.checkHostFor(s); err != nil {
		return err
	}
	h.checkedMu.Lock()
	if h.checked == nil {
		h.checked = map[string]bool{}
	}
	h.checked[key] = true
	h.checkedMu.Unlock()
	return nil
}

func (h *Host) checkHostFor(s snapshot.Snapshot) error {
	compat, err := snapshot.LoadCompat(s.Dir)
	if err != nil {
		return err
	}
	typ, err := h.d.DomainType()
	if err != nil {
		return err
	}
	if err := compat.Check(h.d.Conn(), typ); err != nil {
		return fmt.Errorf("snapshot %q: %w", s.Name, err)
	}
	return nil
}
