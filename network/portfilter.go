package network

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The port filter pins every box's bridge port to the box's MAC and IPv4
// address: from a box, only IPv4 from its own address and ARP that names
// its own MAC and address get onto the bridge (no DHCP server, no IPv6, no
// other ethertype); to a box, only IPv4 and ARP. It is one nftables table
// of the bridge family, kvbox's for all its bridges (github.com/google/nftables,
// over netlink), with a set of (tap, MAC, address) triples, one per box. A
// box's tap is its own on whichever bridge, so no rule names a bridge (the
// kernel's bridge-name match, nft_meta_bridge, is missing on some hosts,
// this test machine among them).
//
// Why not libvirt's nwfilter, which kvbox used first: libvirt instantiates
// a filter by running ebtables, iptables and ip6tables, 60-odd commands at
// every domain start and again at every stop whatever the filter holds:
// most of a clone's start and of kvbox rm, and more with every box on the
// host, as each command of iptables-nft reads the whole ruleset
// (docs/design.md#libvirts-nwfilter). Here a box is one
// set element, added before it is defined and removed with it: its port is
// filtered from the first frame, also when an operator starts it with virsh,
// since the tap's name is the box's own (TapName, libvirt's <target dev>).

// tapPrefix starts the name of every box's tap device.
const tapPrefix = "kvb"

// TapName is the tap device of the box with this MAC: "kvb" and the MAC's
// 12 hex digits (15 characters, IFNAMSIZ-1). It is the same at every start
// of the box, so the port filter holds it before the box runs.
func TapName(mac string) string {
	return tapPrefix + strings.ReplaceAll(strings.ToLower(mac), ":", "")
}

// portKeyType is a port's key: tap . MAC . address.
var portKeyType = nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeEtherAddr, nftables.TypeIPAddr)

func portKey(tap, mac string, ip netip.Addr) ([]byte, error) {
	hw, err := net.ParseMAC(mac)
	if err != nil || len(hw) != 6 {
		return nil, fmt.Errorf("port filter: MAC %q: %v", mac, err)
	}
	if !ip.Is4() {
		return nil, fmt.Errorf("port filter: %s is not an IPv4 address", ip)
	}
	if len(tap) >= unix.IFNAMSIZ {
		return nil, fmt.Errorf("port filter: device name %q is too long", tap)
	}
	// Each field is padded to 4 bytes, as the registers it is loaded into.
	k := make([]byte, portKeyType.Bytes)
	copy(k[0:16], tap)
	copy(k[16:22], hw)
	a := ip.As4()
	copy(k[24:28], a[:])
	return k, nil
}

func filterTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyBridge, Name: tableName}
}

func portSet(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: "ports", KeyType: portKeyType, Concatenation: true}
}

// offlineSet holds the taps of boxes with no route out of the host
// (AllowPort's offline): what such a box sends the host, which the host
// would route beyond the bridge, is dropped on the bridge's local path.
// Its bridge still forwards what it sends to the boxes of its group.
func offlineSet(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: "offline", KeyType: nftables.TypeIFName}
}

func offlineKey(tap string) ([]byte, error) {
	if len(tap) >= unix.IFNAMSIZ {
		return nil, fmt.Errorf("port filter: device name %q is too long", tap)
	}
	k := make([]byte, nftables.TypeIFName.Bytes)
	copy(k, tap)
	return k, nil
}

// The reserved link-local group addresses 01:80:c2:00:00:0X are not
// forwarded by a Linux bridge: a frame to one of them goes up its port's own
// stack (the tap's, an interface of the host), past every rule of the
// bridge's forwarding path. The kernel (net/bridge/br_input.c) runs the
// bridge family's input hook, with the port as input device, for most of
// them; for 01:80:c2:00:00:0e (LLDP), and for 01:80:c2:00:00:00 on a bridge
// with STP, it runs no hook at all. Left open, that path lets a box reach
// host UDP sockets on every address of the host (IPv4 with its own or a
// spoofed address, IPv6 to the tap's link-local one), put its MAC in the
// host's neighbour tables, teach the bridge a spoofed MAC on its port, and
// with one router advertisement give the host an IPv6 default route through
// the box, an address, a hop limit and an MTU. Three locks, each keyed by
// names and kinds that hold before any tap exists, so a tap is covered from
// the moment libvirt makes it:
//   - every kvbox bridge forwards every link-local group address the kernel
//     lets it (groupFwdMask), so those frames take the bridge's forwarding
//     path, where the port filter drops them from a box's port first of all;
//   - the bridge table's input chain drops the rest (01:80:c2:00:00:02,
//     which the kernel never forwards) before the bridge passes it up;
//   - a box's tap is no interface of the host's at all: kvbox's inet and arp
//     tables drop IPv4, IPv6 and ARP that arrive on one or leave through one
//     (a tap is "kvb*" of kind tun; the bridges, also "kvb*", are not
//     tun), whatever path brought them there: a bridge quirk, a tap left up
//     outside its bridge, a kernel that adds another exception.
// Nothing else on the host is touched: no sysctl of the host's, no rule
// outside kvbox's tables.

// tableName names each of kvbox's nftables tables (bridge, inet, arp).
const tableName = "kvbox"

// chainSpec is one base chain of kvbox's with its rules.
type chainSpec struct {
	chain *nftables.Chain
	rules [][]expr.Any
}

func baseChain(t *nftables.Table, name string, hook *nftables.ChainHook, prio *nftables.ChainPriority) *nftables.Chain {
	accept := nftables.ChainPolicyAccept
	return &nftables.Chain{Name: name, Table: t, Type: nftables.ChainTypeFilter, Hooknum: hook, Priority: prio, Policy: &accept}
}

// portChains are the chains of kvbox's bridge table.
func portChains(set *nftables.Set) []chainSpec {
	t, prio := set.Table, nftables.ChainPriorityRef(-200)
	return []chainSpec{
		{baseChain(t, "from-boxes", nftables.ChainHookPrerouting, prio), fromBoxRules(set)},
		{baseChain(t, "to-boxes", nftables.ChainHookPostrouting, prio), toBoxRules()},
		{baseChain(t, "to-host", nftables.ChainHookInput, prio), toHostRules(offlineSet(t))},
	}
}

// tapStackChains are the chains of kvbox's inet and arp tables, which keep
// a box's tap out of the host's own IP and ARP stacks.
func tapStackChains() []chainSpec {
	inet := &nftables.Table{Family: nftables.TableFamilyINet, Name: tableName}
	arp := &nftables.Table{Family: nftables.TableFamilyARP, Name: tableName}
	prio := nftables.ChainPriorityFilter
	drop := func(dirs ...bool) [][]expr.Any {
		var r [][]expr.Any
		for _, in := range dirs {
			r = append(r, append(tapDevice(in), verdict(expr.VerdictDrop)))
		}
		return r
	}
	return []chainSpec{
		// Locally delivered with a tap as input device: only what went up
		// the tap's own stack (with br_netfilter, what the bridge passes
		// up has the bridge as input device here).
		{baseChain(inet, "input", nftables.ChainHookInput, prio), drop(true)},
		// Routed by the host from or to a tap (not bridged: with
		// br_netfilter, bridged frames have the bridge as devices here).
		{baseChain(inet, "forward", nftables.ChainHookForward, prio), drop(true, false)},
		// The host's own packets sent on a tap, past the bridge and its
		// port filter: its IPv6 chatter (solicitations, reports).
		{baseChain(inet, "output", nftables.ChainHookOutput, prio), drop(false)},
		{baseChain(arp, "input", nftables.ChainHookRef(nfARPIn), prio), drop(true)},
		{baseChain(arp, "output", nftables.ChainHookRef(nfARPOut), prio), drop(false)},
	}
}

// nft_meta's interface kind keys (linux/netfilter/nf_tables.h), which
// golang.org/x/sys does not name: dev->rtnl_link_ops->kind, "tun" for a
// tap, "bridge" for a bridge.
const (
	metaIIFKind expr.MetaKey = 26
	metaOIFKind expr.MetaKey = 27
)

// The arp family's hooks (linux/netfilter_arp.h).
const (
	nfARPIn  nftables.ChainHook = 0
	nfARPOut nftables.ChainHook = 1
)

// tapDevice matches a packet whose input (or output) device is a box's tap.
func tapDevice(in bool) []expr.Any {
	name, kind := expr.MetaKeyIIFNAME, metaIIFKind
	if !in {
		name, kind = expr.MetaKeyOIFNAME, metaOIFKind
	}
	return []expr.Any{
		&expr.Meta{Key: name, Register: reg}, cmp(expr.CmpOpEq, []byte(tapPrefix)...),
		&expr.Meta{Key: kind, Register: reg}, cmp(expr.CmpOpEq, 't', 'u', 'n', 0),
	}
}

// EnsurePortFilter makes kvbox's tables, or makes one again whole when
// part of it is gone (a chain or set deleted by hand), and says whether it
// made the bridge table afresh (then no box is in it yet: after a host
// reboot, on kvbox's first use, or after such a repair).
func EnsurePortFilter() (created bool, err error) {
	conn, err := nftables.New()
	if err != nil {
		return false, fmt.Errorf("port filter: %w", err)
	}
	if missing, err := missingChains(conn); err != nil || len(missing) == 0 {
		return false, err
	}
	// Two kvbox commands setting the filter up at once would both make
	// the table and append its rules twice.
	unlock, err := lockNetwork("port-filter")
	if err != nil {
		return false, fmt.Errorf("port filter: %w", err)
	}
	defer unlock()
	missing, err := missingChains(conn)
	if err != nil || len(missing) == 0 {
		return false, err
	}
	t := filterTable()
	set := portSet(t)
	bridge := portChains(set)
	if missing[offlineSetKey] || slices.ContainsFunc(bridge, func(c chainSpec) bool { return missing[c.chain.Name] }) {
		// No table, or part of it: made whole, no box in it yet (the
		// caller puts every box in).
		if missing[offlineSetKey] || slices.ContainsFunc(bridge, func(c chainSpec) bool { return !missing[c.chain.Name] }) {
			conn.DelTable(t)
		}
		conn.AddTable(t)
		for _, st := range []*nftables.Set{set, offlineSet(t)} {
			if err := conn.AddSet(st, nil); err != nil {
				return false, fmt.Errorf("port filter: %w", err)
			}
		}
		for _, c := range bridge {
			addChain(conn, c)
		}
		created = true
	}
	for _, fam := range []nftables.TableFamily{nftables.TableFamilyINet, nftables.TableFamilyARP} {
		specs := familyChains(tapStackChains(), fam)
		if !slices.ContainsFunc(specs, func(c chainSpec) bool { return missing[chainKey(c.chain)] }) {
			continue
		}
		t := specs[0].chain.Table
		if !slices.ContainsFunc(specs, func(c chainSpec) bool { return !missing[chainKey(c.chain)] }) {
			conn.AddTable(t)
		} else {
			// Part of it: made again whole (it holds no state).
			conn.DelTable(t)
			conn.AddTable(t)
		}
		for _, c := range specs {
			addChain(conn, c)
		}
	}
	// One batch: every table appears whole or not at all.
	if err := conn.Flush(); err != nil {
		return false, fmt.Errorf("port filter: make kvbox's tables: %w", err)
	}
	return created, nil
}

func addChain(conn *nftables.Conn, c chainSpec) {
	conn.AddChain(c.chain)
	for _, r := range c.rules {
		conn.AddRule(&nftables.Rule{Table: c.chain.Table, Chain: c.chain, Exprs: r})
	}
}

func familyChains(specs []chainSpec, fam nftables.TableFamily) []chainSpec {
	var r []chainSpec
	for _, c := range specs {
		if c.chain.Table.Family == fam {
			r = append(r, c)
		}
	}
	return r
}

// chainKey names a chain of the bridge table by its name, those of the
// other tables by family and name.
func chainKey(c *nftables.Chain) string {
	if c.Table.Family == nftables.TableFamilyBridge {
		return c.Name
	}
	return fmt.Sprintf("%d/%s", c.Table.Family, c.Name)
}

// offlineSetKey names the offline set among missingChains' chains.
const offlineSetKey = "set offline"

// missingChains lists, by chainKey, the chains of kvbox's tables that are
// not in the kernel, and the offline set (offlineSetKey) when the bridge
// table is there without it.
func missingChains(conn *nftables.Conn) (map[string]bool, error) {
	chains, err := conn.ListChains()
	if err != nil {
		return nil, fmt.Errorf("port filter: list chains: %w", err)
	}
	have := map[string]bool{}
	for _, c := range chains {
		if c.Table.Name == tableName {
			have[chainKey(c)] = true
		}
	}
	missing := map[string]bool{}
	for _, c := range append(portChains(portSet(filterTable())), tapStackChains()...) {
		if !have[chainKey(c.chain)] {
			missing[chainKey(c.chain)] = true
		}
	}
	if !missing["from-boxes"] {
		if _, err := conn.GetSetByName(filterTable(), offlineSet(filterTable()).Name); err != nil {
			missing[offlineSetKey] = true
		}
	}
	return missing, nil
}

// Registers: NFT_REG_1 (16 bytes) for plain matches; a concatenation is
// loaded into the 4-byte registers from NFT_REG32_00 on, each field padded
// to 4 bytes, as the set's key is.
const (
	reg     = unix.NFT_REG_1
	regTap  = unix.NFT_REG32_00 // 16 bytes
	regMAC  = unix.NFT_REG32_04 // 6 bytes (+2)
	regAddr = unix.NFT_REG32_06 // 4 bytes
)

func load(base expr.PayloadBase, off, n, dst uint32) expr.Any {
	return &expr.Payload{OperationType: expr.PayloadLoad, Base: base, Offset: off, Len: n, DestRegister: dst}
}

func cmp(op expr.CmpOp, data ...byte) expr.Any {
	return &expr.Cmp{Op: op, Register: reg, Data: data}
}

func verdict(k expr.VerdictKind) expr.Any { return &expr.Verdict{Kind: k} }

// otherPorts accepts what does not concern a box: frames of a port that is
// no box's tap.
func otherPorts(port expr.MetaKey) []expr.Any {
	return []expr.Any{&expr.Meta{Key: port, Register: reg}, cmp(expr.CmpOpNeq, []byte(tapPrefix)...), verdict(expr.VerdictAccept)}
}

// fromBoxRules: frames a box sends.
func fromBoxRules(set *nftables.Set) [][]expr.Any {
	etherType := func(t uint16) []expr.Any {
		return []expr.Any{load(expr.PayloadBaseLLHeader, 12, 2, reg), cmp(expr.CmpOpEq, byte(t>>8), byte(t))}
	}
	lookup := func(macOff, addrOff uint32, macBase expr.PayloadBase) []expr.Any {
		return []expr.Any{
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: regTap},
			load(macBase, macOff, 6, regMAC),
			load(expr.PayloadBaseNetworkHeader, addrOff, 4, regAddr),
			&expr.Lookup{SourceRegister: regTap, SetName: set.Name, SetID: set.ID},
		}
	}
	rules := [][]expr.Any{otherPorts(expr.MetaKeyIIFNAME), dropLinkLocal()}
	// No DHCP server on a box (boxes have static addresses).
	rules = append(rules, append(etherType(unix.ETH_P_IP),
		load(expr.PayloadBaseNetworkHeader, 9, 1, reg), cmp(expr.CmpOpEq, unix.IPPROTO_UDP),
		load(expr.PayloadBaseTransportHeader, 0, 2, reg), cmp(expr.CmpOpEq, 0, 67),
		verdict(expr.VerdictDrop)))
	// IPv4 from the box's own MAC and address.
	ip := append(etherType(unix.ETH_P_IP), lookup(6, 12, expr.PayloadBaseLLHeader)...)
	rules = append(rules, append(ip, verdict(expr.VerdictAccept)))
	// ARP for Ethernet and IPv4 whose frame and sender are the box's own
	// MAC and address (no gratuitous ARP for the gateway or another box).
	arp := append(etherType(unix.ETH_P_ARP),
		load(expr.PayloadBaseNetworkHeader, 0, 6, reg), cmp(expr.CmpOpEq, 0, 1, 8, 0, 6, 4))
	arp = append(arp, lookup(6, 14, expr.PayloadBaseLLHeader)...)
	arp = append(arp, lookup(8, 14, expr.PayloadBaseNetworkHeader)...)
	rules = append(rules, append(arp, verdict(expr.VerdictAccept)))
	// Everything else: spoofed IPv4 or ARP, RARP, all IPv6 (router
	// advertisements, neighbour spoofing), any other ethertype.
	return append(rules, []expr.Any{verdict(expr.VerdictDrop)})
}

// dropLinkLocal drops a frame to a reserved link-local group address
// (01:80:c2:00:00:00 to 01:80:c2:00:00:0f): nothing a box needs, and the
// bridge would hand it up the tap's own stack.
func dropLinkLocal() []expr.Any {
	return []expr.Any{
		load(expr.PayloadBaseLLHeader, 0, 6, reg),
		&expr.Bitwise{SourceRegister: reg, DestRegister: reg, Len: 6,
			Mask: []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xf0}, Xor: make([]byte, 6)},
		cmp(expr.CmpOpEq, 0x01, 0x80, 0xc2, 0, 0, 0),
		verdict(expr.VerdictDrop),
	}
}

// toHostRules: what the bridge passes up from a box's port. Frames it
// forwarded passed the port filter on their way in; a frame to a reserved
// link-local group address did not, and is dropped here before the bridge
// hands it up the tap's stack (and learns its source MAC). IPv4 of a box
// with no route out goes no further: the host would route it (the host's
// own services drop it anyway), and ARP alone reaches nothing.
func toHostRules(offline *nftables.Set) [][]expr.Any {
	noRoute := []expr.Any{
		load(expr.PayloadBaseLLHeader, 12, 2, reg), cmp(expr.CmpOpEq, byte(unix.ETH_P_IP>>8), byte(unix.ETH_P_IP&0xff)),
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: reg},
		&expr.Lookup{SourceRegister: reg, SetName: offline.Name, SetID: offline.ID},
		verdict(expr.VerdictDrop),
	}
	return [][]expr.Any{otherPorts(expr.MetaKeyIIFNAME), dropLinkLocal(), noRoute}
}

// toBoxRules: frames to a box: IPv4 and ARP only.
func toBoxRules() [][]expr.Any {
	return [][]expr.Any{otherPorts(expr.MetaKeyOIFNAME), {
		load(expr.PayloadBaseLLHeader, 12, 2, reg),
		cmp(expr.CmpOpNeq, byte(unix.ETH_P_IP>>8), byte(unix.ETH_P_IP&0xff)),
		cmp(expr.CmpOpNeq, byte(unix.ETH_P_ARP>>8), byte(unix.ETH_P_ARP&0xff)),
		verdict(expr.VerdictDrop),
	}}
}

// ErrNoPortFilter: kvbox's port filter is not there (another kvbox's
// network rm took it away with its last port): EnsurePortFilter makes it
// again, with every box's port.
var ErrNoPortFilter = errors.New("kvbox's port filter is not there")

// AllowPort lets the box with this tap, MAC and address through its port
// (and nothing else of it); offline, nothing it sends is routed beyond its
// bridge. Adding a port already there changes nothing.
// Ports are added under the port filter's lock, which removePortFilter
// holds from its check that no port is left until the tables are gone: a
// port is added before that check, or finds the tables gone
// (ErrNoPortFilter), never lost between the two.
func AllowPort(tap, mac string, ip netip.Addr, offline bool) error {
	unlock, err := lockNetwork("port-filter")
	if err != nil {
		return fmt.Errorf("port filter: %w", err)
	}
	defer unlock()
	err = portElement(tap, mac, ip, true, offline)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%w: %w", ErrNoPortFilter, err)
	}
	return err
}

// ForgetPort takes a box's port out of the filter; one not there is fine.
func ForgetPort(tap, mac string, ip netip.Addr) error {
	err := portElement(tap, mac, ip, false, false)
	if errors.Is(err, os.ErrNotExist) {
		err = nil
	}
	// Whether or not it was offline: nothing of its tap stays behind.
	if oerr := offlineElement(tap); oerr != nil && !errors.Is(oerr, os.ErrNotExist) && err == nil {
		err = oerr
	}
	return err
}

func portElement(tap, mac string, ip netip.Addr, add, offline bool) error {
	k, err := portKey(tap, mac, ip)
	if err != nil {
		return err
	}
	ok, err := offlineKey(tap)
	if err != nil {
		return err
	}
	conn, err := nftables.New()
	if err != nil {
		return fmt.Errorf("port filter: %w", err)
	}
	t := filterTable()
	el := []nftables.SetElement{{Key: k}}
	if add {
		// One batch: the port never passes without its offline mark.
		if offline {
			err = conn.SetAddElements(offlineSet(t), []nftables.SetElement{{Key: ok}})
		}
		if err == nil {
			err = conn.SetAddElements(portSet(t), el)
		}
	} else {
		err = conn.SetDeleteElements(portSet(t), el)
	}
	if err == nil {
		err = conn.Flush()
	}
	if err != nil {
		return fmt.Errorf("port filter: %s %s (%s %s): %w", map[bool]string{true: "add", false: "remove"}[add], tap, mac, ip, err)
	}
	return nil
}

// offlineElement takes a tap out of the offline set.
func offlineElement(tap string) error {
	k, err := offlineKey(tap)
	if err != nil {
		return err
	}
	conn, err := nftables.New()
	if err != nil {
		return fmt.Errorf("port filter: %w", err)
	}
	if err := conn.SetDeleteElements(offlineSet(filterTable()), []nftables.SetElement{{Key: k}}); err != nil {
		return fmt.Errorf("port filter: forget %s as offline: %w", tap, err)
	}
	if err := conn.Flush(); err != nil {
		return fmt.Errorf("port filter: forget %s as offline: %w", tap, err)
	}
	return nil
}

// removePortFilter deletes kvbox's tables once no box is in its port
// filter (network rm of the last bridge with boxes).
func removePortFilter() error {
	unlock, err := lockNetwork("port-filter")
	if err != nil {
		return fmt.Errorf("port filter: %w", err)
	}
	defer unlock()
	conn, err := nftables.New()
	if err != nil {
		return fmt.Errorf("port filter: %w", err)
	}
	t := filterTable()
	if set, err := conn.GetSetByName(t, portSet(t).Name); err == nil {
		if els, err := conn.GetSetElements(set); err != nil || len(els) > 0 {
			return err
		}
	}
	tables, err := conn.ListTables()
	if err != nil {
		return fmt.Errorf("port filter: list tables: %w", err)
	}
	del := false
	for _, x := range tables {
		if x.Name == tableName && (x.Family == nftables.TableFamilyBridge || x.Family == nftables.TableFamilyINet || x.Family == nftables.TableFamilyARP) {
			conn.DelTable(x)
			del = true
		}
	}
	if removeEgress(conn) {
		del = true
	}
	if !del {
		return nil
	}
	if err := conn.Flush(); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("port filter: remove kvbox's tables: %w", err)
	}
	return nil
}
