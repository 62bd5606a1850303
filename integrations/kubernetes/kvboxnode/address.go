package kvboxnode

import (
	"fmt"
	"net"
	"net/netip"
	"strings"

	"kvbox.dev/kvbox/network"
)

// Interface is one of the host's network interfaces and its addresses.
type Interface struct {
	Name     string
	Loopback bool
	Prefixes []netip.Prefix
}

// HostInterfaces lists the host's interfaces (of kvbox-node's network
// namespace).
func HostInterfaces() ([]Interface, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("list network interfaces: %w", err)
	}
	var out []Interface
	for _, i := range ifs {
		addrs, err := i.Addrs()
		if err != nil {
			return nil, fmt.Errorf("addresses of %s: %w", i.Name, err)
		}
		x := Interface{Name: i.Name, Loopback: i.Flags&net.FlagLoopback != 0}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				if addr, ok := netip.AddrFromSlice(n.IP); ok {
					bits, _ := n.Mask.Size()
					x.Prefixes = append(x.Prefixes, netip.PrefixFrom(addr.Unmap(), bits))
				}
			}
		}
		out = append(out, x)
	}
	return out, nil
}

// CheckNodeAddress refuses an address the kubelet API must not listen on:
// none, every address (0.0.0.0, ::), one that is not this host's, one in a
// network kvbox puts boxes on (its subnet and its groups' pool), or one on
// a kvbox bridge. The kubelet API runs commands in boxes: a box must never
// reach it.
func CheckNodeAddress(addr netip.Addr, ifaces []Interface, boxNet network.Config) error {
	switch {
	case !addr.IsValid():
		return fmt.Errorf("give --node-address: the host's address the API server reaches this node on (never one boxes reach)")
	case addr.IsUnspecified():
		return fmt.Errorf("--node-address %s would serve the kubelet API on every address of the host, those boxes reach too: give the host's node address", addr)
	case addr.IsMulticast():
		return fmt.Errorf("--node-address %s is a multicast address: give the host's node address", addr)
	}
	for _, p := range []netip.Prefix{boxNet.Subnet, network.GroupPool} {
		if p.IsValid() && p.Contains(addr) {
			return fmt.Errorf("--node-address %s is in %s, where kvbox puts boxes: they could reach the kubelet API there; give the host's node address", addr, p)
		}
	}
	for _, i := range ifaces {
		for _, p := range i.Prefixes {
			if p.Addr() != addr && !(i.Loopback && p.Contains(addr)) {
				continue
			}
			if i.Name == boxNet.Bridge || strings.HasPrefix(i.Name, network.GroupBridgePrefix) {
				return fmt.Errorf("--node-address %s is on %s, a kvbox bridge boxes reach: give the host's node address", addr, i.Name)
			}
			return nil
		}
	}
	return fmt.Errorf("--node-address %s is not an address of this host (ip -brief address lists them)", addr)
}
