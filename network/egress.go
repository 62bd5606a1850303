package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/egress"
)

// A box's egress policy (package egress) is enforced here for addresses,
// and handed to kvbox's proxy and resolver on the host for names. kvbox's
// nftables table `ip kvbox-egress` (beside the port filter's, over netlink)
// holds two verdict maps keyed by a box's source address, which the port
// filter pins to the box's tap:
//   - forward: a box's packets routed beyond its bridge pass its chain
//     f-ADDR: allowed CIDRs pass it, denied ones are dropped (counted);
//   - prerouting (NAT): its chain n-ADDR sends every DNS query (UDP and TCP
//     port 53, to whatever address) to kvbox's resolver, and, where the
//     policy allows names, TCP 443 and 80 to a denied address to kvbox's
//     proxy, which lets the connection through only to a name the policy
//     allows, dialling that name itself.
// A box's chains are made again from its own definition whenever its port
// is (re)filtered (define, start, resume, a host restart) and removed with
// its port: a box that takes an address another box had gets its own
// rules, or none. What a box sends to its own bridge is left to the bridge
// and the port filter.

const egressTableName = "kvbox-egress"

// EgressPorts are the host ports of a state dir's egress proxy (HTTP,
// TLS) and resolver (DNS, UDP and TCP), on every address of the
// namespace, each state dir its own (egress.EnsurePorts): kvbox's input
// chain lets a box reach them only through the redirect.
type EgressPorts = egress.Ports

// EgressRules are one box's address rules.
type EgressRules struct {
	// Own is the box's bridge subnet and Gateway the host on it: traffic
	// there is the bridge's (DNS to the gateway goes to kvbox's resolver).
	Own     netip.Prefix
	Gateway netip.Addr
	Allow   []netip.Prefix
	Deny    []netip.Prefix
	// Proxy: the policy allows names, so TCP 443 and 80 to a denied
	// address go to kvbox's proxy instead of being dropped.
	Proxy bool
	Ports EgressPorts
}

func egressTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyIPv4, Name: egressTableName}
}

func egressMap(t *nftables.Table, name string) *nftables.Set {
	return &nftables.Set{Table: t, Name: name, IsMap: true, KeyType: nftables.TypeIPAddr, DataType: nftables.TypeVerdict}
}

// egressBase are the table's two base chains, each a lookup of the
// source address in its map.
func egressBase(t *nftables.Table) []struct {
	chain *nftables.Chain
	set   *nftables.Set
} {
	accept := nftables.ChainPolicyAccept
	fwd := &nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter, Hooknum: nftables.ChainHookForward,
		Priority: nftables.ChainPriorityRef(-1), Policy: &accept}
	nat := &nftables.Chain{Name: "prerouting", Table: t, Type: nftables.ChainTypeNAT, Hooknum: nftables.ChainHookPrerouting,
		Priority: nftables.ChainPriorityNATDest, Policy: &accept}
	return []struct {
		chain *nftables.Chain
		set   *nftables.Set
	}{{fwd, egressMap(t, "fwd")}, {nat, egressMap(t, "nat")}}
}

func saddrVmap(set *nftables.Set) []expr.Any {
	return []expr.Any{
		load(expr.PayloadBaseNetworkHeader, 12, 4, reg),
		&expr.Lookup{SourceRegister: reg, SetName: set.Name, SetID: set.ID, IsDestRegSet: true, DestRegister: 0},
	}
}

// EnsureEgress makes kvbox's egress table, or makes it again whole when
// part of it is gone, and says whether it made it afresh (then it holds no
// box: after a host reboot, the caller puts every box's rules in).
func EnsureEgress() (created bool, err error) {
	conn, err := nftables.New()
	if err != nil {
		return false, fmt.Errorf("egress rules: %w", err)
	}
	if egressWhole(conn) {
		return false, nil
	}
	unlock, err := lockNetwork("egress")
	if err != nil {
		return false, fmt.Errorf("egress rules: %w", err)
	}
	defer unlock()
	if egressWhole(conn) {
		return false, nil
	}
	t := egressTable()
	if tables, err := conn.ListTablesOfFamily(nftables.TableFamilyIPv4); err == nil && slices.ContainsFunc(tables, func(x *nftables.Table) bool { return x.Name == egressTableName }) {
		conn.DelTable(t)
	}
	conn.AddTable(t)
	for _, b := range egressBase(t) {
		if err := conn.AddSet(b.set, nil); err != nil {
			return false, fmt.Errorf("egress rules: %w", err)
		}
		conn.AddChain(b.chain)
		conn.AddRule(&nftables.Rule{Table: t, Chain: b.chain, Exprs: saddrVmap(b.set)})
	}
	if err := conn.Flush(); err != nil {
		return false, fmt.Errorf("egress rules: make kvbox's egress table: %w", err)
	}
	return true, nil
}

// egressWhole says whether the table is there with both its chains and
// maps.
func egressWhole(conn *nftables.Conn) bool {
	chains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return false
	}
	t := egressTable()
	for _, b := range egressBase(t) {
		if !slices.ContainsFunc(chains, func(c *nftables.Chain) bool { return c.Table.Name == egressTableName && c.Name == b.chain.Name }) {
			return false
		}
		if _, err := conn.GetSetByName(t, b.set.Name); err != nil {
			return false
		}
	}
	return true
}

// egressChainNames are box a's two chains.
func egressChainNames(a netip.Addr) (fwd, nat string) {
	b := a.As4()
	h := fmt.Sprintf("%02x%02x%02x%02x", b[0], b[1], b[2], b[3])
	return "f-" + h, "n-" + h
}

// SetEgress makes the egress rules of the box at address box what r says
// (nil: none, the box passes as any other), in one batch: a new
// connection meets the old rules or the new ones, never none.
func SetEgress(box netip.Addr, r *EgressRules) error {
	if !box.Is4() {
		return fmt.Errorf("egress rules: %s is not an IPv4 address", box)
	}
	unlock, err := lockNetwork("egress")
	if err != nil {
		return fmt.Errorf("egress rules: %w", err)
	}
	defer unlock()
	conn, err := nftables.New()
	if err != nil {
		return fmt.Errorf("egress rules: %w", err)
	}
	t := egressTable()
	fname, nname := egressChainNames(box)
	chains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return fmt.Errorf("egress rules: %w", err)
	}
	have := slices.ContainsFunc(chains, func(c *nftables.Chain) bool { return c.Table.Name == egressTableName && c.Name == fname })
	key := box.AsSlice()
	base := egressBase(t)
	fchain := &nftables.Chain{Name: fname, Table: t}
	nchain := &nftables.Chain{Name: nname, Table: t}
	if r == nil {
		if !have {
			return nil
		}
		for i, c := range []*nftables.Chain{fchain, nchain} {
			if err := conn.SetDeleteElements(base[i].set, []nftables.SetElement{{Key: key}}); err != nil {
				return fmt.Errorf("egress rules of %s: %w", box, err)
			}
			conn.FlushChain(c)
			conn.DelChain(c)
		}
	} else {
		rules, err := egressChainRules(*r)
		if err != nil {
			return err
		}
		for i, c := range []*nftables.Chain{fchain, nchain} {
			conn.AddChain(c)
			if have {
				conn.FlushChain(c)
			}
			for _, e := range rules[i] {
				conn.AddRule(&nftables.Rule{Table: t, Chain: c, Exprs: e})
			}
			el := nftables.SetElement{Key: key, VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: c.Name}}
			if err := conn.SetAddElements(base[i].set, []nftables.SetElement{el}); err != nil {
				return fmt.Errorf("egress rules of %s: %w", box, err)
			}
		}
	}
	if err := conn.Flush(); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%w: egress rules of %s: %w", ErrNoEgressTable, box, err)
		}
		return fmt.Errorf("egress rules of %s: %w", box, err)
	}
	return nil
}

// ErrNoEgressTable: kvbox's egress table is not there (EnsureEgress).
var ErrNoEgressTable = errors.New("kvbox's egress table is not there")

// daddrIn matches a destination address in p.
func daddrIn(p netip.Prefix) []expr.Any {
	a := p.Masked().Addr().As4()
	mask := binary.BigEndian.AppendUint32(nil, ^uint32(0)<<(32-p.Bits()))
	if p.Bits() == 0 {
		mask = []byte{0, 0, 0, 0}
	}
	return []expr.Any{
		load(expr.PayloadBaseNetworkHeader, 16, 4, reg),
		&expr.Bitwise{SourceRegister: reg, DestRegister: reg, Len: 4, Mask: mask, Xor: make([]byte, 4)},
		cmp(expr.CmpOpEq, a[:]...),
	}
}

// l4 matches the transport protocol and destination port.
func l4(proto byte, port uint16) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: reg}, cmp(expr.CmpOpEq, proto),
		load(expr.PayloadBaseTransportHeader, 2, 2, reg), cmp(expr.CmpOpEq, byte(port>>8), byte(port)),
	}
}

// redirect sends the packet's connection to port on the host (the
// address of the interface it came in on: the bridge's gateway).
func redirect(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: reg, Data: []byte{byte(port >> 8), byte(port)}},
		&expr.Redir{RegisterProtoMin: reg},
	}
}

func join(parts ...[]expr.Any) []expr.Any {
	var r []expr.Any
	for _, p := range parts {
		r = append(r, p...)
	}
	return r
}

// egressChainRules are a box's forward and NAT chains' rules.
func egressChainRules(r EgressRules) ([2][][]expr.Any, error) {
	var out [2][][]expr.Any
	if !r.Own.IsValid() || !r.Gateway.Is4() {
		return out, fmt.Errorf("egress rules: the box's subnet and gateway are needed")
	}
	if r.Ports == (EgressPorts{}) {
		return out, fmt.Errorf("egress rules: the state dir's proxy ports are needed")
	}
	ret, accept, drop := verdict(expr.VerdictReturn), verdict(expr.VerdictAccept), verdict(expr.VerdictDrop)
	// Forward: its own bridge is not this table's; allow beats deny.
	fwd := [][]expr.Any{join(daddrIn(r.Own), []expr.Any{ret})}
	for _, p := range r.Allow {
		fwd = append(fwd, join(daddrIn(p), []expr.Any{accept}))
	}
	for _, p := range r.Deny {
		fwd = append(fwd, join(daddrIn(p), []expr.Any{&expr.Counter{}, drop}))
	}
	// NAT: every DNS query to kvbox's resolver (the gateway's included);
	// allowed CIDRs untouched; with names, the web ports of denied
	// addresses to the proxy.
	gw := netip.PrefixFrom(r.Gateway, 32)
	var nat [][]expr.Any
	for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
		nat = append(nat, join(daddrIn(gw), l4(proto, 53), redirect(r.Ports.DNS)))
	}
	nat = append(nat, join(daddrIn(r.Own), []expr.Any{ret}))
	for _, proto := range []byte{unix.IPPROTO_UDP, unix.IPPROTO_TCP} {
		nat = append(nat, join(l4(proto, 53), redirect(r.Ports.DNS)))
	}
	for _, p := range r.Allow {
		nat = append(nat, join(daddrIn(p), []expr.Any{ret}))
	}
	if r.Proxy {
		for _, p := range r.Deny {
			nat = append(nat,
				join(daddrIn(p), l4(unix.IPPROTO_TCP, 443), redirect(r.Ports.TLS)),
				join(daddrIn(p), l4(unix.IPPROTO_TCP, 80), redirect(r.Ports.HTTP)))
		}
	}
	out[0], out[1] = fwd, nat
	return out, nil
}

// EgressDropped is how many packets of the box at address box its
// egress rules dropped (to denied addresses) since they were last set.
func EgressDropped(box netip.Addr) (uint64, error) {
	conn, err := nftables.New()
	if err != nil {
		return 0, err
	}
	fname, _ := egressChainNames(box)
	rules, err := conn.GetRules(egressTable(), &nftables.Chain{Name: fname, Table: egressTable()})
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, r := range rules {
		for _, e := range r.Exprs {
			if c, ok := e.(*expr.Counter); ok {
				n += c.Packets
			}
		}
	}
	return n, nil
}

// HasEgress says whether the box at address box has egress rules.
func HasEgress(box netip.Addr) bool {
	conn, err := nftables.New()
	if err != nil {
		return false
	}
	fname, _ := egressChainNames(box)
	chains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
	return err == nil && slices.ContainsFunc(chains, func(c *nftables.Chain) bool { return c.Table.Name == egressTableName && c.Name == fname })
}

// removeEgress deletes kvbox's egress table (with the port filter's).
func removeEgress(conn *nftables.Conn) bool {
	if tables, err := conn.ListTablesOfFamily(nftables.TableFamilyIPv4); err == nil && slices.ContainsFunc(tables, func(x *nftables.Table) bool { return x.Name == egressTableName }) {
		conn.DelTable(egressTable())
		return true
	}
	return false
}
