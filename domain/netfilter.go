package domain

import (
	"errors"

	"libvirt.org/go/libvirtxml"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/network"
)

// EnsureNetwork sets up kvbox's bridge, its firewall and NAT, and its port
// filter (EnsurePortFilter).
func (h *Host) EnsureNetwork() error {
	if err := h.Net.Ensure(); err != nil {
		return err
	}
	return h.EnsurePortFilter()
}

// EnsurePortFilter makes kvbox's port filter unless it is there; one made
// afresh (after a host reboot) gets every box at once.
func (h *Host) EnsurePortFilter() error {
	created, err := network.EnsurePortFilter()
	if err != nil {
		return err
	}
	egressCreated, err := network.EnsureEgress()
	if err != nil {
		return err
	}
	if created || egressCreated {
		// Every state dir's boxes: the filter is the namespace's, and a
		// box of another state dir must not lose its port.
		boxes, err := h.AllBoxes()
		if err != nil {
			return err
		}
		for _, b := range boxes {
			if err := h.AllowPort(b); err != nil {
				return err
			}
		}
	}
	return nil
}

// portFiltered reports whether a box has a port in kvbox's port filter: a
// box on a bridge (its tap is named after its MAC).
func portFiltered(b Box) bool {
	return b.Bridge != "" && b.MAC != "" && b.IP != ""
}

// AllowPort puts a box's port in kvbox's port filter (before it starts:
// from its first frame only its own MAC and address get through).
func (h *Host) AllowPort(b Box) error {
	if !portFiltered(b) {
		return nil
	}
	tap := network.TapName(b.MAC)
	err := network.AllowPort(tap, b.MAC, b.Addr(), b.NoInternet)
	if errors.Is(err, network.ErrNoPortFilter) {
		// Another kvbox removed the filter with its last port since this
		// one made sure of it: made again, then the port.
		if err := h.EnsurePortFilter(); err != nil {
			return err
		}
		err = network.AllowPort(tap, b.MAC, b.Addr(), b.NoInternet)
	}
	if err != nil {
		return err
	}
	return h.applyEgress(b)
}

// ForgetPort takes a removed box's port out of the filter.
func (h *Host) ForgetPort(b Box) error {
	if !portFiltered(b) {
		return nil
	}
	err := network.ForgetPort(network.TapName(b.MAC), b.MAC, b.Addr())
	if eerr := h.forgetEgress(b); err == nil {
		err = eerr
	}
	return err
}

// filterInterfaces makes every interface of a rendered box an isolated
// port (not isolated in a box group) on kvbox's bridge (or its group's)
// whose tap is named after the box's MAC, the name
// kvbox's port filter holds. The built-in template has both; an operator's
// template without them gets them inserted (its boxes would otherwise
// spoof and reach each other). Refused: an interface kvbox's firewall does
// not see (not on kvbox's bridge), more than one, or another tap name.
func filterInterfaces(x string, d TemplateData) (string, error) {
	var dom libvirtxml.Domain
	if err := dom.Unmarshal(x); err != nil {
		return "", base.Errorf(base.Invalid, "domain template renders XML libvirt cannot read: %v", err)
	}
	if dom.Devices == nil || len(dom.Devices.Interfaces) == 0 {
		return x, nil
	}
	if d.Bridge == "" {
		return "", base.Errorf(base.Invalid, "domain template gives a box without network (--network none) an interface: wrap <interface> in {{if .Bridge}} ... {{end}}")
	}
	if len(dom.Devices.Interfaces) != 1 {
		return "", base.Errorf(base.Invalid, "domain template: a box has one network interface (its MAC and address), not %d", len(dom.Devices.Interfaces))
	}
	changed := false
	ifc := &dom.Devices.Interfaces[0]
	if ifc.Source == nil || ifc.Source.Bridge == nil || ifc.Source.Bridge.Bridge != d.Bridge {
		return "", base.Errorf(base.Invalid, "domain template: the interface must be <interface type='bridge'> on kvbox's bridge %s (%s), where kvbox's firewall sees it", d.Bridge, describeInterface(ifc))
	}
	if d.IP == "" {
		return "", base.Errorf(base.Invalid, "domain template: an interface without an address for kvbox's port filter")
	}
	switch {
	case ifc.Target == nil || ifc.Target.Dev == "":
		ifc.Target = &libvirtxml.DomainInterfaceTarget{Dev: d.Tap}
		changed = true
	case ifc.Target.Dev != d.Tap:
		return "", base.Errorf(base.Invalid, "domain template: the interface's tap must be kvbox's <target dev='{{.Tap}}'/> (%s), which its port filter holds, not %q", d.Tap, ifc.Target.Dev)
	}
	isolated := ifc.PortOptions != nil && ifc.PortOptions.Isolated == "yes"
	switch {
	case d.Group == "" && !isolated:
		ifc.PortOptions = &libvirtxml.DomainInterfacePortOptions{Isolated: "yes"}
		changed = true
	case d.Group != "" && ifc.PortOptions != nil && ifc.PortOptions.Isolated != "":
		ifc.PortOptions = nil // a box group's boxes reach each other
		changed = true
	}
	if !changed {
		return x, nil
	}
	out, err := dom.Marshal()
	if err != nil {
		return "", base.Errorf(base.Invalid, "domain template: %v", err)
	}
	return out, nil
}

func describeInterface(ifc *libvirtxml.DomainInterface) string {
	switch s := ifc.Source; {
	case s == nil:
		return "one has no source"
	case s.Bridge != nil:
		return "one is on bridge " + s.Bridge.Bridge
	case s.Network != nil:
		return "one is on libvirt network " + s.Network.Network
	case s.User != nil:
		return "one is user-mode networking"
	case s.Direct != nil:
		return "one is a macvtap on " + s.Direct.Dev
	}
	return "one is of another type"
}
