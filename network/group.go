package network

import (
	"crypto/sha256"
	"encoding/base32"
	"fmt"
	"net/netip"
	"strings"

	"github.com/coreos/go-iptables/iptables"
	"github.com/vishvananda/netlink"
)

// Box groups. Boxes are isolated from each other by default: every box is
// an isolated port of kvbox's bridge. Boxes that should talk to each other
// say so with a group (kvbox new --network group:NAME): a group is a bridge
// of its own (GroupBridge), with a subnet of its own (GroupSubnet) and the
// same firewall (the host's services, private ranges and 169.254/16 out of
// reach, the internet through NAT where the main network has it) and the
// same port filter (each box its own MAC and address only), whose ports are
// not isolated: the boxes of a group reach each other and no other box.

// GroupBridge is the bridge of group: "kvbg" and 11 characters of the
// base32 of the SHA-256 of its name, 55 bits (an interface name has at most
// 15 characters). Two groups never share a bridge: a group whose bridge
// name another group's bridge already has is refused (Config.claim on the
// bridge, the domain package on boxes' metadata).
func GroupBridge(group string) string {
	sum := sha256.Sum256([]byte(group))
	return GroupBridgePrefix + strings.ToLower(base32.StdEncoding.EncodeToString(sum[:]))[:11]
}

// GroupBridgePrefix begins the name of every group's bridge.
const GroupBridgePrefix = "kvbg"

// groupAlias is the interface alias that marks a group's bridge as that
// group's.
func groupAlias(group string) string { return groupAliasPrefix + group }

const groupAliasPrefix = "kvbox group "

// BridgeGroup is the group a bridge's alias marks it as (the Group of its
// Config); ok is false for a bridge no kvbox marked.
func BridgeGroup(alias string) (group string, ok bool) {
	return strings.CutPrefix(alias, groupAliasPrefix)
}

// claim makes sure a group's bridge is its group's, and marks it so: a
// bridge marked with another group's name (their bridge names agree) is
// refused, one not marked (made just now) is marked.
// kvbox's main bridge is no group's.
func (c Config) claim(link netlink.Link) error {
	if c.Group == "" {
		return nil
	}
	switch want, have := groupAlias(c.Group), link.Attrs().Alias; {
	case have == want:
		return nil
	case have == "":
		if err := netlink.LinkSetAlias(link, want); err != nil {
			return fmt.Errorf("bridge %s: mark it as group %q's: %w", c.Bridge, c.Group, err)
		}
		return nil
	default:
		return fmt.Errorf("group %q: its bridge %s is already %s (the two names' bridge names agree): choose another group name", c.Group, c.Bridge, strings.TrimPrefix(have, "kvbox "))
	}
}

// GroupPool is where group subnets are taken from, a /24 each.
var GroupPool = netip.MustParsePrefix("172.30.0.0/16")

// GroupConfig is the network of group on bridge and subnet.
func GroupConfig(group, bridge string, subnet netip.Prefix) Config {
	return Config{Bridge: bridge, Subnet: subnet.Masked(), Group: group}
}

// GroupSubnet picks a /24 of GroupPool for a new group: one that overlaps
// none of taken (the main network's and other groups' subnets) and no
// address or route of this host (a LAN, a VPN, another program's bridge).
func GroupSubnet(taken []netip.Prefix) (netip.Prefix, error) {
	inUse := append([]netip.Prefix(nil), taken...)
	routes, err := Routes()
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("group subnet: %w", err)
	}
	for _, r := range routes {
		inUse = append(inUse, r.Prefix)
	}
	base := GroupPool.Masked().Addr().As4()
	for i := 1; i < 256; i++ {
		p := netip.PrefixFrom(netip.AddrFrom4([4]byte{base[0], base[1], byte(i), 0}), 24)
		free := true
		for _, u := range inUse {
			if u.Overlaps(p) {
				free = false
				break
			}
		}
		if free {
			return p, nil
		}
	}
	return netip.Prefix{}, fmt.Errorf("no free /24 left in %s for a new group", GroupPool)
}

// EnsureGroup sets up a group's bridge and firewall, with NAT when the main
// network has it (a group reaches what the host's other boxes reach).
func (c Config) EnsureGroup(main Config) error {
	nat := hasUplink()
	if !nat {
		if ipt, err := iptables.New(); err == nil {
			nat = main.hasNAT(ipt)
		}
	}
	return c.ensure(nat)
}

// RemoveGroup deletes a group's bridge, firewall and NAT; kvbox's port
// filter, which every bridge shares, stays.
func (c Config) RemoveGroup() error {
	return c.remove(false)
}
