package domain

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"

	"github.com/vishvananda/netlink"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/statedir"
)

// Box groups (network/group.go): boxes of one group share a bridge of their
// own where they reach each other. A group exists while it has boxes: its
// network is made with its first box and removed with its last. Its boxes'
// metadata is all kvbox keeps of it (the group's name, bridge and subnet),
// so a host reboot loses nothing: starting a box of the group makes its
// network again.

// ValidGroup checks a group name: a box name's rules.
func ValidGroup(group string) error { return base.ValidName(group) }

// groupKey names group's network on the host (its bridge, and the mark
// on it): the group's name in the default state dir, and the name with the
// state dir in another, so that the groups of one name of two kvboxes on
// one host (two state dirs) are two networks that never reach each other.
func (h *Host) groupKey(group string) string {
	if h.StateDir == statedir.Default {
		return group
	}
	return group + "@" + filepath.Clean(h.StateDir)
}

// ownsGroupKey says a group's network, by the key its bridge is marked
// with, is one of this state dir's groups.
func (h *Host) ownsGroupKey(key string) bool {
	if h.StateDir == statedir.Default {
		return !strings.Contains(key, "@")
	}
	return strings.HasSuffix(key, "@"+filepath.Clean(h.StateDir))
}

// groupOf is the network of the group box b is in.
func (h *Host) groupOf(b Box) (network.Config, error) {
	key := h.groupKey(b.Group)
	gw, err := netip.ParseAddr(b.Gateway)
	if err != nil || b.Prefix <= 0 || b.Bridge != network.GroupBridge(key) {
		return network.Config{}, fmt.Errorf("box %q: its metadata holds no network for group %q (gateway %q/%d, bridge %q)", b.Name, b.Group, b.Gateway, b.Prefix, b.Bridge)
	}
	return network.GroupConfig(key, b.Bridge, netip.PrefixFrom(gw, b.Prefix)), nil
}

// GroupNetwork is the network a new box of group goes on, set up: the main
// network for "", else the group's, with the subnet its boxes have, or a new
// one for its first box. Call it under the host lock, which the box's
// definition is made under (two first boxes of two groups must not take one
// subnet); it first removes the networks of groups that have no box left (a
// first box that failed leaves its group's network for this to remove: its
// undo runs outside the lock).
func (h *Host) GroupNetwork(group string) (network.Config, error) {
	if group == "" {
		return h.Net, nil
	}
	if err := ValidGroup(group); err != nil {
		return network.Config{}, fmt.Errorf("group %q: %w", group, err)
	}
	all, err := h.AllBoxes()
	if err != nil {
		return network.Config{}, err
	}
	h.pruneGroups(h.own(all))
	for _, b := range h.own(all) {
		if b.Group == group {
			nc, err := h.groupOf(b)
			if err != nil {
				return network.Config{}, err
			}
			return nc, nc.EnsureGroup(h.Net)
		}
	}
	// A new group: a bridge no box is on, and a subnet no group of any
	// state dir has (its bridge may be down until its first box starts).
	key := h.groupKey(group)
	br := network.GroupBridge(key)
	if err := bridgeFree(all, group, br); err != nil {
		return network.Config{}, err
	}
	taken := []netip.Prefix{h.Net.Subnet}
	for _, b := range all {
		if gw, err := netip.ParseAddr(b.Gateway); err == nil && b.Group != "" && b.Prefix > 0 {
			taken = append(taken, netip.PrefixFrom(gw, b.Prefix).Masked())
		}
	}
	sub, err := network.GroupSubnet(taken)
	if err != nil {
		return network.Config{}, err
	}
	nc := network.GroupConfig(key, br, sub)
	return nc, nc.EnsureGroup(h.Net)
}

// bridgeFree refuses a new group whose bridge name a box of another group
// is on already: two groups never share a bridge (they would reach each
// other, and removing one would take the other's firewall).
func bridgeFree(boxes []Box, group, bridge string) error {
	for _, b := range boxes {
		if b.Group != group && b.Bridge == bridge {
			return base.Errorf(base.Invalid, "group %q: its bridge %s is group %q's already (box %s; their names' bridge names agree): choose another group name", group, bridge, b.Group, b.Name)
		}
	}
	return nil
}

// EnsureBoxNetwork sets up the network box b is on before it starts: the
// main network, and its group's when it is in one (after a host reboot
// the group's bridge is gone until its first box starts again).
func (h *Host) EnsureBoxNetwork(b Box) error {
	if err := h.EnsureNetwork(); err != nil {
		return err
	}
	if b.Group == "" {
		return nil
	}
	nc, err := h.groupOf(b)
	if err != nil {
		return err
	}
	return nc.EnsureGroup(h.Net)
}

// PruneGroups removes the networks of this state dir's groups no box is in
// any more: a group's bridge, firewall and NAT go with its last box.
func (h *Host) PruneGroups(ctx context.Context) error {
	boxes, unlock, err := h.lockedBoxes(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	return h.pruneGroups(boxes)
}

func (h *Host) pruneGroups(boxes []Box) error {
	inUse := map[string]bool{}
	for _, b := range boxes {
		inUse[b.Bridge] = true
	}
	links, err := netlink.LinkList()
	if err != nil {
		return err
	}
	var errs []string
	for _, l := range links {
		name := l.Attrs().Name
		if l.Type() != "bridge" || !strings.HasPrefix(name, network.GroupBridgePrefix) || inUse[name] {
			continue
		}
		// Another state dir's group is another kvbox's to remove; a
		// bridge no kvbox marked is the default state dir's (as before
		// bridges were marked).
		key, marked := network.BridgeGroup(l.Attrs().Alias)
		if (marked && !h.ownsGroupKey(key)) || (!marked && h.StateDir != statedir.Default) {
			continue
		}
		addrs, _ := netlink.AddrList(l, netlink.FAMILY_V4)
		nc := network.Config{Bridge: name, Group: name}
		if len(addrs) > 0 {
			ones, _ := addrs[0].Mask.Size()
			a, _ := netip.AddrFromSlice(addrs[0].IP.To4())
			nc.Subnet = netip.PrefixFrom(a, ones).Masked()
		}
		if err := nc.RemoveGroup(); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if errs != nil {
		return fmt.Errorf("remove the network of a group without boxes: %s", strings.Join(errs, "; "))
	}
	return nil
}
