package domain

import (
	"fmt"

	"libvirt.org/go/libvirtxml"

	"kvbox.dev/kvbox/network"
)

// EnsureNetwork sets up kvbox's bridge, its firewall and NAT, and the
// libvirt network filter every box's port references.
func (h *Host) EnsureNetwork() error {
	if err := h.Net.Ensure(); err != nil {
		return err
	}
	return network.EnsureFilter(h.Conn)
}

// filterInterfaces makes every interface of a rendered box hold kvbox's
// port filter with the box's own address, on an isolated bridge port. The
// built-in template has both; an operator's template without them gets them
// inserted (its boxes would otherwise spoof and reach each other). Refused:
// an interface kvbox's firewall does not see (not on kvbox's bridge), or
// one referencing another filter or another address.
func filterInterfaces(x string, d TemplateData) (string, error) {
	var dom libvirtxml.Domain
	if err := dom.Unmarshal(x); err != nil {
		return "", fmt.Errorf("%w: domain template renders XML libvirt cannot read: %v", ErrInvalid, err)
	}
	if dom.Devices == nil || len(dom.Devices.Interfaces) == 0 {
		return x, nil
	}
	if d.Bridge == "" {
		return "", fmt.Errorf("%w: domain template gives a box without network (--network none) an interface: wrap <interface> in {{if .Bridge}} ... {{end}}", ErrInvalid)
	}
	changed := false
	for i := range dom.Devices.Interfaces {
		ifc := &dom.Devices.Interfaces[i]
		if ifc.Source == nil || ifc.Source.Bridge == nil || ifc.Source.Bridge.Bridge != d.Bridge {
			return "", fmt.Errorf("%w: domain template: every interface must be <interface type='bridge'> on kvbox's bridge %s (%s), where kvbox's firewall sees it", ErrInvalid, d.Bridge, describeInterface(ifc))
		}
		if d.IP == "" {
			return "", fmt.Errorf("%w: domain template: an interface without an address for kvbox's port filter", ErrInvalid)
		}
		want := libvirtxml.DomainInterfaceFilterRef{Filter: network.FilterName, Parameters: []libvirtxml.DomainInterfaceFilterParam{{Name: "IP", Value: d.IP}}}
		switch f := ifc.FilterRef; {
		case f == nil:
			ifc.FilterRef = &want
			changed = true
		case f.Filter != want.Filter || len(f.Parameters) != 1 || f.Parameters[0] != want.Parameters[0]:
			return "", fmt.Errorf("%w: domain template: the interface must reference kvbox's port filter as <filterref filter='{{.Filter}}'><parameter name='IP' value='{{.IP}}'/></filterref>, not %q with %v", ErrInvalid, f.Filter, f.Parameters)
		}
		if ifc.PortOptions == nil || ifc.PortOptions.Isolated != "yes" {
			ifc.PortOptions = &libvirtxml.DomainInterfacePortOptions{Isolated: "yes"}
			changed = true
		}
	}
	if !changed {
		return x, nil
	}
	out, err := dom.Marshal()
	if err != nil {
		return "", fmt.Errorf("%w: domain template: %v", ErrInvalid, err)
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
