// Package network owns kvbox's bridge on the host: creating it, handing out
// static addresses on it, NAT for outbound traffic, and opening or closing a
// box's port on the bridge.
package network

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/coreos/go-iptables/iptables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Config describes kvbox's network.
type Config struct {
	Bridge string       // bridge device, e.g. kvbox0
	Subnet netip.Prefix // e.g. 172.30.0.0/24; the first host address is the gateway
	// Group names the box group this bridge is of (group.go): its ports
	// are not isolated. Empty for kvbox's main network.
	Group string
}

// Default is kvbox's network unless configured otherwise.
var Default = Config{Bridge: "kvbox0", Subnet: netip.MustParsePrefix("172.30.0.0/24")}

// Parse builds a Config from a bridge name and a subnet in CIDR form.
func Parse(bridge, subnet string) (Config, error) {
	p, err := netip.ParsePrefix(subnet)
	if err != nil || !p.Addr().Is4() {
		return Config{}, fmt.Errorf("subnet %q is not an IPv4 prefix like 172.30.0.0/24", subnet)
	}
	if p.Bits() > 29 || p.Bits() < 8 {
		return Config{}, fmt.Errorf("subnet %q: prefix length must be between /8 and /29", subnet)
	}
	if bridge == "" || len(bridge) > 15 || strings.ContainsAny(bridge, "/ \t") {
		return Config{}, fmt.Errorf("bridge name %q is not a valid interface name", bridge)
	}
	return Config{Bridge: bridge, Subnet: p.Masked()}, nil
}

// Gateway is the host's address on the bridge.
func (c Config) Gateway() netip.Addr { return c.Subnet.Masked().Addr().Next() }

// Ensure creates the bridge with the gateway address if it is missing, brings
// it up, puts kvbox's firewall in place, and sets up NAT where the host has a
// default route.
func (c Config) Ensure() error { return c.ensure(hasUplink()) }

// EnsureNAT is Ensure with NAT whether or not the host has a default route
// (an uplink reached through more specific routes); NAT stays until the
// network is removed.
func (c Config) EnsureNAT() error { return c.ensure(true) }

func (c Config) ensure(nat bool) error {
	link, created, err := c.bridgeLink()
	if err != nil {
		return err
	}
	if link.Type() != "bridge" {
		return fmt.Errorf("%s exists and is a %s, not a bridge", c.Bridge, link.Type())
	}
	if err := c.claim(link); err != nil {
		return err
	}
	if err := c.subnetFree(link.Attrs().Index); err != nil {
		if created {
			netlink.LinkDel(link)
		}
		return err
	}
	if err := c.bridgeUp(link); err != nil {
		return err
	}
	return c.firewall(nat)
}

// bridgeLink is the bridge's link, made when there is none (created).
func (c Config) bridgeLink() (netlink.Link, bool, error) {
	link, err := netlink.LinkByName(c.Bridge)
	if err == nil {
		return link, false, nil
	}
	var nf netlink.LinkNotFoundError
	if !errors.As(err, &nf) {
		return nil, false, fmt.Errorf("look up bridge %s: %w", c.Bridge, err)
	}
	created := false
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: c.Bridge}}
	switch err := netlink.LinkAdd(br); {
	case err == nil:
		created = true
	case !errors.Is(err, os.ErrExist):
		return nil, false, fmt.Errorf("create bridge %s: %w", c.Bridge, err)
	}
	if link, err = netlink.LinkByName(c.Bridge); err != nil {
		return nil, created, fmt.Errorf("look up bridge %s: %w", c.Bridge, err)
	}
	return link, created, nil
}

// bridgeUp sets the bridge up as boxes need it: link-local group
// addresses forwarded, the gateway's address, no IPv6 for the host, up.
func (c Config) bridgeUp(link netlink.Link) error {
	if b, ok := link.(*netlink.Bridge); !ok || b.GroupFwdMask == nil || *b.GroupFwdMask != groupFwdMask {
		if err := setGroupFwdMask(link.Attrs().Index, groupFwdMask); err != nil {
			return fmt.Errorf("bridge %s: forward link-local group addresses: %w", c.Bridge, err)
		}
	}
	gw := &netlink.Addr{IPNet: &net.IPNet{IP: c.Gateway().AsSlice(), Mask: net.CIDRMask(c.Subnet.Bits(), 32)}}
	if err := netlink.AddrAdd(link, gw); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("add %s to %s: %w", gw.IPNet, c.Bridge, err)
	}
	// The host takes no IPv6 router advertisement, nor any IPv6 address,
	// from the bridge (boxes' IPv6 is also dropped by the port filter). A
	// kernel without IPv6 has no such files.
	for _, k := range []string{"accept_ra", "autoconf", "disable_ipv6"} {
		v := "0\n"
		if k == "disable_ipv6" {
			v = "1\n"
		}
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+c.Bridge+"/"+k, []byte(v), 0o644); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("IPv6 off on %s: %w", c.Bridge, err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("bring %s up: %w", c.Bridge, err)
	}
	return nil
}

// firewall makes the bridge's firewall rules, and NAT when nat, what they
// should be, changing nothing when they are.
func (c Config) firewall(nat bool) error {
	ipt, err := iptables.New()
	if err != nil {
		return fmt.Errorf("firewall for %s: %w", c.Bridge, err)
	}
	if c.firewallRight(ipt) && (!nat || c.hasNAT(ipt)) {
		if nat {
			return setForwarding()
		}
		return nil
	}
	// Changes are serialized: two kvbox commands setting up the same
	// bridge at once would interleave flushes and appends, or record
	// ip_forward twice (the second seeing the first's 1).
	unlock, err := lockNetwork(c.Bridge)
	if err != nil {
		return fmt.Errorf("firewall for %s: %w", c.Bridge, err)
	}
	defer unlock()
	if err := c.ensureFirewall(ipt); err != nil {
		return err
	}
	if nat {
		return c.ensureNAT(ipt)
	}
	return nil
}

// subnetFree refuses a subnet of which a route of another link in this
// namespace takes some part (another program's bridge, a LAN, a second
// kvbox state dir's network): the kernel would send the boxes' replies
// there, and they would be unreachable without a word. A broader route (a
// VPN's 10.0.0.0/8) loses the subnet to the bridge and is no clash. The
// bridge's own routes are its subnet's.
func (c Config) subnetFree(bridge int) error {
	routes, err := Routes()
	if err != nil {
		return fmt.Errorf("subnet %s: %w", c.Subnet, err)
	}
	for _, r := range routes {
		if r.Link == bridge {
			continue
		}
		if p := r.Prefix; p.Overlaps(c.Subnet) && p.Bits() >= c.Subnet.Bits() {
			dev := fmt.Sprintf("link %d", r.Link)
			if l, err := netlink.LinkByIndex(r.Link); err == nil {
				dev = l.Attrs().Name
			}
			return fmt.Errorf("subnet %s of bridge %s overlaps %s, routed to %s: choose another subnet (--subnet, KVBOX_SUBNET) or remove what uses it", c.Subnet, c.Bridge, p, dev)
		}
	}
	return nil
}

// Route is an IPv4 route of this network namespace: where to, and the
// index of the link it goes out of.
type Route struct {
	Prefix netip.Prefix
	Link   int
}

// Routes lists this namespace's IPv4 routes with a destination (the
// default route overlaps everything and nothing, and is left out).
func Routes() ([]Route, error) {
	routes, err := netlink.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("list routes: %w", err)
	}
	var out []Route
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		if a, ok := netip.AddrFromSlice(r.Dst.IP.To4()); ok {
			bits, _ := r.Dst.Mask.Size()
			out = append(out, Route{Prefix: netip.PrefixFrom(a, bits), Link: r.LinkIndex})
		}
	}
	return out, nil
}

// groupFwdMask has a bridge forward (through its forwarding path, where
// kvbox's port filter drops them) every reserved link-local group address
// 01:80:c2:00:00:0X it may: all but 00 (forwarded anyway without STP),
// 01 (pause frames, dropped) and 02 (never forwarded: kvbox's input chain
// drops it), which the kernel refuses in the mask. See portfilter.go.
const groupFwdMask uint16 = 0xfff8

// setGroupFwdMask sets a bridge's group_fwd_mask, and nothing else of it
// (netlink.LinkModify would send every attribute of the link again).
func setGroupFwdMask(index int, mask uint16) error {
	req := nl.NewNetlinkRequest(unix.RTM_NEWLINK, unix.NLM_F_ACK)
	msg := nl.NewIfInfomsg(unix.AF_UNSPEC)
	msg.Index = int32(index)
	req.AddData(msg)
	info := nl.NewRtAttr(unix.IFLA_LINKINFO, nil)
	info.AddRtAttr(nl.IFLA_INFO_KIND, nl.NonZeroTerminated("bridge"))
	data := info.AddRtAttr(nl.IFLA_INFO_DATA, nil)
	data.AddRtAttr(nl.IFLA_BR_GROUP_FWD_MASK, nl.Uint16Attr(mask))
	req.AddData(info)
	_, err := req.Execute(unix.NETLINK_ROUTE, 0)
	return err
}

// Status is what `kvbox network show` reports.
type Status struct {
	Bridge  string `json:"bridge"`
	Subnet  string `json:"subnet"`
	Gateway string `json:"gateway"`
	Present bool   `json:"present"` // the bridge exists
	NAT     bool   `json:"nat"`     // kvbox's masquerade rule is in place
	// Firewall: kvbox's isolation chains for this bridge are in place.
	Firewall bool `json:"firewall"`
}

// Status reads the state of the network on this host.
func (c Config) Status() Status {
	st := Status{Bridge: c.Bridge, Subnet: c.Subnet.String(), Gateway: c.Gateway().String()}
	if l, err := netlink.LinkByName(c.Bridge); err == nil && l.Type() == "bridge" {
		st.Present = true
	}
	if ipt, err := iptables.New(); err == nil {
		_, st.NAT = c.natRule(ipt)
		st.Firewall, _ = ipt.ChainExists("filter", c.fwdChain())
	}
	return st
}

// Remove deletes the bridge and kvbox's firewall rules.
func (c Config) Remove() error { return c.remove(true) }

func (c Config) remove(portFilter bool) error {
	var errs []error
	if ipt, err := iptables.New(); err == nil {
		if err := c.removeNAT(ipt); err != nil {
			errs = append(errs, fmt.Errorf("NAT for %s: %w", c.Bridge, err))
		}
		errs = append(errs, c.removeFirewall(ipt)...)
	} else {
		errs = append(errs, err)
	}
	if portFilter {
		if err := removePortFilter(); err != nil {
			errs = append(errs, err)
		}
	}
	if link, err := netlink.LinkByName(c.Bridge); err == nil {
		if err := netlink.LinkDel(link); err != nil {
			errs = append(errs, fmt.Errorf("delete bridge %s: %w", c.Bridge, err))
		}
	}
	return errors.Join(errs...)
}

type rule struct {
	table, chain string
	spec         []string
}

// hasUplink reports whether this network namespace has an IPv4 default route.
func hasUplink() bool {
	routes, err := netlink.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Dst: nil}, netlink.RT_FILTER_DST)
	if err != nil {
		return false
	}
	for _, r := range routes {
		if r.Dst == nil || r.Dst.IP.IsUnspecified() {
			return true
		}
	}
	return false
}

// Addresses is how many boxes the subnet holds: its host addresses less
// the gateway (the addresses Allocate hands out).
func (c Config) Addresses() int {
	host := 32 - c.Subnet.Bits()
	if host < 2 {
		return 0
	}
	return 1<<host - 3
}

// Allocate returns the lowest host address of the subnet that is neither the
// gateway nor in used. The caller serializes allocations (kvbox holds its
// state lock from Allocate until the address is recorded in a domain).
func (c Config) Allocate(used []netip.Addr) (netip.Addr, error) {
	taken := map[netip.Addr]bool{c.Gateway(): true}
	for _, a := range used {
		taken[a] = true
	}
	last := lastAddr(c.Subnet)
	for a := c.Gateway().Next(); a.Less(last); a = a.Next() {
		if !taken[a] {
			return a, nil
		}
	}
	return netip.Addr{}, fmt.Errorf("no free address left in %s", c.Subnet)
}

// lastAddr is the broadcast address of p.
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As4()
	host := 32 - p.Bits()
	for i := 3; i >= 0 && host > 0; i-- {
		n := min(host, 8)
		b[i] |= byte(1<<n - 1)
		host -= n
	}
	return netip.AddrFrom4(b)
}

// ForgetNeighbor drops the host's ARP entry for an address on the bridge.
// An address handed to a new box may still map to the MAC of the box that
// had it before; until that entry times out the host could not reach the
// new box.
func (c Config) ForgetNeighbor(ip netip.Addr) {
	br, err := netlink.LinkByName(c.Bridge)
	if err != nil {
		return
	}
	netlink.NeighDel(&netlink.Neigh{LinkIndex: br.Attrs().Index, Family: netlink.FAMILY_V4, IP: ip.AsSlice()})
}

// NewMAC returns a random MAC address in QEMU's 52:54:00 range.
func NewMAC() string {
	var b [3]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return fmt.Sprintf("52:54:00:%02x:%02x:%02x", b[0], b[1], b[2])
}

// ClosePort takes a box's tap device down and detaches it from the bridge,
// so not one frame of the box reaches other boxes or the host. Down first:
// a detached tap that is up is an interface of the host's own, where the
// host's IP stack takes the box's frames (an echo request to the gateway
// was answered) and the port filter, a bridge rule, no longer applies. The
// kernel refuses what QEMU writes to a tap that is down.
func ClosePort(tap string) error {
	link, err := netlink.LinkByName(tap)
	if err != nil {
		return fmt.Errorf("close port %s: %w", tap, err)
	}
	if err := netlink.LinkSetDown(link); err != nil {
		return fmt.Errorf("close port %s: %w", tap, err)
	}
	if err := netlink.LinkSetNoMaster(link); err != nil {
		return fmt.Errorf("close port %s: %w", tap, err)
	}
	return nil
}

// OpenPort attaches a box's tap device to the bridge as an isolated port
// (not isolated on a group's bridge) and brings it up. A new bridge port
// starts with the kernel's defaults (not isolated), so the tap is down
// until the flag is set: not one frame passes between boxes meanwhile.
// libvirt sets the flag itself for a box it attaches (<port
// isolated='yes'/>); this is for a clone's port, which kvbox re-attaches.
func (c Config) OpenPort(tap string) error {
	link, err := netlink.LinkByName(tap)
	if err != nil {
		return fmt.Errorf("open port %s: %w", tap, err)
	}
	br, err := netlink.LinkByName(c.Bridge)
	if err != nil {
		return fmt.Errorf("open port %s: bridge %s: %w", tap, c.Bridge, err)
	}
	if err := netlink.LinkSetDown(link); err != nil {
		return fmt.Errorf("open port %s: %w", tap, err)
	}
	if err := netlink.LinkSetMaster(link, br); err != nil {
		return fmt.Errorf("open port %s on %s: %w", tap, c.Bridge, err)
	}
	if err := netlink.LinkSetIsolated(link, c.Group == ""); err != nil {
		netlink.LinkSetNoMaster(link)
		return fmt.Errorf("open port %s on %s: isolate it: %w", tap, c.Bridge, err)
	}
	return netlink.LinkSetUp(link)
}
