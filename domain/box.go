package domain

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"sort"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
)

// Box is one kvbox box as libvirt and its metadata describe it.
type Box struct {
	Name        string `json:"name"`
	UUID        string `json:"uuid"`
	State       State  `json:"state"`
	Meta               // image or snapshot, ip, mac, ...
	CPUs        int    `json:"cpus"`
	MemoryBytes int64  `json:"memory_bytes"`
	VsockCID    uint32 `json:"vsock_cid,omitempty"`
	Tap         string `json:"tap,omitempty"`
}

// DiskFile is a box's disk in its folder: a qcow2 overlay on a version of
// its image, or on its snapshot's disk.
const DiskFile = "disk.qcow2"

// Disk is the path of the box's disk.
func (b Box) Disk() string { return filepath.Join(b.Dir, DiskFile) }

// Addr is the box's address.
func (b Box) Addr() netip.Addr {
	a, _ := netip.ParseAddr(b.IP)
	return a
}

// From is the box's origin: its image, or the snapshot it was cloned from.
func (b Box) From() string {
	if b.Snapshot != "" {
		return "snapshot " + b.Snapshot
	}
	return "image " + b.Image
}

// State is what a box is doing, as kvbox lists it.
type State string

// The states of a box. Suspended is kvbox's own suspend (its memory and
// device state on disk, no QEMU); a guest that put itself to sleep (ACPI
// S3, which libvirt calls pmsuspended) is StatePMSuspended, a running QEMU
// whose guest waits for a wake-up.
const (
	StateRunning      State = "running"
	StateBlocked      State = "blocked"
	StatePaused       State = "paused"
	StateShuttingDown State = "shutting-down"
	StateStopped      State = "stopped"
	StateCrashed      State = "crashed"
	StateSuspended    State = "suspended"
	StatePMSuspended  State = "pmsuspended"
	StateUnknown      State = "unknown"
)

// NoQEMU says no QEMU runs for a box in this state: it can be removed
// without powering it off.
func (s State) NoQEMU() bool {
	return s == StateStopped || s == StateCrashed || s == StateSuspended
}

// Bootable says the box can be booted (kvbox start): it is stopped or
// crashed.
func (s State) Bootable() bool { return s == StateStopped || s == StateCrashed }

// stateOf is the state of a domain in libvirt state s; suspended says the
// box's metadata holds a kvbox suspend (which libvirt sees as shut off).
func stateOf(s libvirt.DomainState, suspended bool) State {
	switch s {
	case libvirt.DOMAIN_RUNNING:
		return StateRunning
	case libvirt.DOMAIN_BLOCKED:
		return StateBlocked
	case libvirt.DOMAIN_PAUSED:
		return StatePaused
	case libvirt.DOMAIN_SHUTDOWN:
		return StateShuttingDown
	case libvirt.DOMAIN_SHUTOFF:
		if suspended {
			return StateSuspended
		}
		return StateStopped
	case libvirt.DOMAIN_CRASHED:
		return StateCrashed
	case libvirt.DOMAIN_PMSUSPENDED:
		return StatePMSuspended
	}
	return StateUnknown
}

// boxOf reads a domain; ok is false when it is not a kvbox box.
func boxOf(d *libvirt.Domain) (b Box, ok bool, err error) {
	x, err := d.GetXMLDesc(0)
	if err != nil {
		return Box{}, false, fmt.Errorf("read domain XML: %w", err)
	}
	dx, err := parseDomainXML(x)
	if err != nil {
		return Box{}, false, err
	}
	if dx.Metadata == nil {
		return Box{}, false, nil
	}
	st, _, err := d.GetState()
	if err != nil {
		return Box{}, false, fmt.Errorf("read domain state: %w", err)
	}
	b = Box{Name: dx.Name, UUID: dx.UUID, State: stateOf(st, dx.Metadata.Suspended != nil), Meta: *dx.Metadata, CPUs: dx.VCPU, MemoryBytes: dx.memoryBytes()}
	if dx.Devices.Vsock != nil {
		b.VsockCID = dx.Devices.Vsock.CID.Address
	}
	if len(dx.Devices.Interfaces) > 0 {
		b.Tap = dx.Devices.Interfaces[0].Target.Dev
	}
	return b, true, nil
}

// MetaOfXML is the kvbox metadata in a domain XML (a snapshot's
// domain.xml); ok is false when it has none.
func MetaOfXML(x string) (m Meta, ok bool, err error) {
	dx, err := parseDomainXML(x)
	if err != nil || dx.Metadata == nil {
		return Meta{}, false, err
	}
	return *dx.Metadata, true, nil
}

// Boxes lists this state dir's boxes, sorted by name. Domains without
// kvbox metadata are not boxes, and the boxes of another state dir (another
// kvbox on the same libvirt) are another kvbox's: both are left out.
func (h *Host) Boxes() ([]Box, error) {
	all, err := h.AllBoxes()
	return h.own(all), err
}

// Owns says box b is one of this state dir's: its folder is in it.
func (h *Host) Owns(b Box) bool {
	return b.Dir != "" && filepath.Dir(b.Dir) == h.Layout().Boxes()
}

// own is the boxes of boxes that this state dir owns.
func (h *Host) own(boxes []Box) []Box {
	var out []Box
	for _, b := range boxes {
		if h.Owns(b) {
			out = append(out, b)
		}
	}
	return out
}

// AllBoxes lists the boxes of every state dir on this libvirt, for what
// they share: addresses, bridges, group subnets.
func (h *Host) AllBoxes() ([]Box, error) {
	doms, err := h.Conn().ListAllDomains(0)
	if err != nil {
		return nil, fmt.Errorf("list domains: %s", LibvirtMessage(err))
	}
	var out []Box
	for i := range doms {
		b, ok, err := boxOf(&doms[i])
		doms[i].Free()
		if isNoDomain(err) {
			continue // removed while we looked
		}
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, b)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// NoBoxError says no domain of that name exists (as opposed to a domain that
// is not a box); it is of kind NotFound.
type NoBoxError struct{ Name string }

func (e NoBoxError) Error() string {
	return fmt.Sprintf("box %q does not exist (kvbox ls lists boxes)", e.Name)
}

func (e NoBoxError) Unwrap() error { return base.ErrNotFound }

// Lookup returns the named box and its domain; the caller frees the domain.
func (h *Host) Lookup(name string) (Box, *libvirt.Domain, error) {
	if err := base.ValidName(name); err != nil {
		return Box{}, nil, err
	}
	d, err := h.Conn().LookupDomainByName(name)
	if isNoDomain(err) {
		return Box{}, nil, NoBoxError{name}
	}
	if err != nil {
		return Box{}, nil, fmt.Errorf("look up %q: %s", name, LibvirtMessage(err))
	}
	b, ok, err := boxOf(d)
	if isNoDomain(err) {
		// Undefined between the look-up and the read (its reaper, a
		// kvbox rm beside): gone, as AllBoxes takes it.
		d.Free()
		return Box{}, nil, NoBoxError{name}
	}
	if err != nil {
		d.Free()
		return Box{}, nil, err
	}
	if !ok {
		d.Free()
		return Box{}, nil, base.Errorf(base.NotFound, "domain %q is not a kvbox box (it has no kvbox metadata)", name)
	}
	if !h.Owns(b) {
		d.Free()
		return Box{}, nil, base.Errorf(base.NotFound, "box %q is another kvbox's (its folder %s is not in state dir %s)", name, b.Dir, h.StateDir)
	}
	return b, d, nil
}

// Get returns the named box.
func (h *Host) Get(name string) (Box, error) {
	b, d, err := h.Lookup(name)
	if err != nil {
		return Box{}, err
	}
	d.Free()
	return b, nil
}

// UsedAddrs lists every address held by a box of any state dir. Call it
// under Lock.
func (h *Host) UsedAddrs() ([]netip.Addr, error) {
	boxes, err := h.AllBoxes()
	if err != nil {
		return nil, err
	}
	var used []netip.Addr
	for _, b := range boxes {
		if a := b.Addr(); a.IsValid() {
			used = append(used, a)
		}
	}
	return used, nil
}

// NameFree reports an error of kind Exists when a domain (a box or not) has the name.
func (h *Host) NameFree(name string) error {
	d, err := h.Conn().LookupDomainByName(name)
	if err == nil {
		d.Free()
		return base.Errorf(base.Exists, "a box or domain named %q already exists (pick another name, or kvbox rm %s)", name, name)
	}
	if !isNoDomain(err) {
		return fmt.Errorf("look up %q: %s", name, LibvirtMessage(err))
	}
	return nil
}
