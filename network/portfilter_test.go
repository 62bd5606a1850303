package network

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// A packet as a netfilter hook sees it.
type hookPacket struct {
	iif, iifKind, oif, oifKind string
	frame                      []byte // from the Ethernet header on
}

// nftVM runs kvbox's chains the way nf_tables does for the expressions
// they use: registers of 4 bytes (NFT_REG_1 is NFT_REG32_00..03), loads
// that zero the tail of their last register, compares, a bitwise, a set
// lookup, verdicts.
type nftVM struct {
	regs [80]byte
	set  map[string]bool // the keys of the sets, by set name and key
}

func regOff(r uint32) int {
	if r <= unix.NFT_REG_4 {
		return int(r) * 16
	}
	return (int(r) - unix.NFT_REG32_00 + 4) * 4
}

func (vm *nftVM) put(r uint32, b []byte) {
	o := regOff(r)
	if len(b)%4 != 0 {
		copy(vm.regs[o+len(b)/4*4:o+len(b)/4*4+4], []byte{0, 0, 0, 0})
	}
	copy(vm.regs[o:], b)
}

func ifname(s string) []byte { b := make([]byte, 16); copy(b, s); return b }

// rule runs one rule: its verdict, or "" when a comparison failed.
func (vm *nftVM) rule(t *testing.T, p hookPacket, exprs []expr.Any) expr.VerdictKind {
	const next = expr.VerdictKind(-100)
	for _, e := range exprs {
		switch e := e.(type) {
		case *expr.Meta:
			v := map[expr.MetaKey]string{expr.MetaKeyIIFNAME: p.iif, expr.MetaKeyOIFNAME: p.oif, metaIIFKind: p.iifKind, metaOIFKind: p.oifKind}
			s, ok := v[e.Key]
			if !ok {
				t.Fatalf("meta key %d is not modelled", e.Key)
			}
			vm.put(e.Register, ifname(s))
		case *expr.Payload:
			var base []byte
			switch e.Base {
			case expr.PayloadBaseLLHeader:
				base = p.frame
			case expr.PayloadBaseNetworkHeader:
				base = p.frame[14:]
			case expr.PayloadBaseTransportHeader:
				base = p.frame[14+int(p.frame[14]&0xf)*4:]
			}
			if int(e.Offset+e.Len) > len(base) {
				return next // the kernel breaks the rule on a short packet
			}
			vm.put(e.DestRegister, base[e.Offset:e.Offset+e.Len])
		case *expr.Bitwise:
			src, dst := regOff(e.SourceRegister), regOff(e.DestRegister)
			out := make([]byte, e.Len)
			for i := range out {
				out[i] = vm.regs[src+i]&e.Mask[i] ^ e.Xor[i]
			}
			copy(vm.regs[dst:], out)
		case *expr.Cmp:
			o := regOff(e.Register)
			eq := bytes.Equal(vm.regs[o:o+len(e.Data)], e.Data)
			if (e.Op == expr.CmpOpEq) != eq {
				return next
			}
		case *expr.Lookup:
			o := regOff(e.SourceRegister)
			n := map[string]int{"ports": int(portKeyType.Bytes), "offline": int(nftables.TypeIFName.Bytes)}[e.SetName]
			if n == 0 {
				t.Fatalf("set %q is not modelled", e.SetName)
			}
			if !vm.set[e.SetName+"/"+string(vm.regs[o:o+n])] {
				return next
			}
		case *expr.Verdict:
			return e.Kind
		default:
			t.Fatalf("expression %T is not modelled", e)
		}
	}
	return next
}

// verdictAt is what kvbox's chains of one family on one hook say of a
// packet: drop if any of them drops it.
func verdictAt(t *testing.T, fam nftables.TableFamily, hook nftables.ChainHook, p hookPacket, set map[string]bool) string {
	t.Helper()
	s := portSet(filterTable())
	for _, c := range append(portChains(s), tapStackChains()...) {
		if c.chain.Table.Family != fam || *c.chain.Hooknum != hook {
			continue
		}
		vm := &nftVM{set: set}
		for _, r := range c.rules {
			v := vm.rule(t, p, r)
			if v == expr.VerdictDrop {
				return "drop"
			}
			if v == expr.VerdictAccept {
				break
			}
		}
	}
	return "accept"
}

const (
	boxMAC  = "52:54:00:ab:cd:0e"
	spoofed = "52:54:00:de:ad:02"
)

var (
	boxTap = TapName(boxMAC)
	boxIP  = netip.MustParseAddr("172.30.0.7")
)

func frame(dst, src string, etherType uint16, payload []byte) []byte {
	d, _ := net.ParseMAC(dst)
	s, _ := net.ParseMAC(src)
	f := append(append(append([]byte(nil), d...), s...), byte(etherType>>8), byte(etherType))
	return append(f, payload...)
}

func ipv4(src, dst netip.Addr, proto byte) []byte {
	h := make([]byte, 28)
	h[0], h[9] = 0x45, proto
	binary.BigEndian.PutUint16(h[2:], 28)
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	binary.BigEndian.PutUint16(h[22:], 5353) // a UDP destination port
	return h
}

// hookAt is a netfilter hook of a family, and its name in messages.
type hookAt struct {
	fam  nftables.TableFamily
	hook nftables.ChainHook
	name string
}

var (
	bridgePre = hookAt{nftables.TableFamilyBridge, *nftables.ChainHookPrerouting, "bridge prerouting"}
	bridgeIn  = hookAt{nftables.TableFamilyBridge, *nftables.ChainHookInput, "bridge input"}
)

// boxFrames are the box's frames TestPortFilterClosesEveryPath sends:
// its port in the filter's set, its own IPv4 to the gateway, an IPv6
// header, and the bridge's MAC.
type boxFrames struct {
	set       map[string]bool
	own, ipv6 []byte
	bridgeMAC string
}

func newBoxFrames(t *testing.T) boxFrames {
	t.Helper()
	k, err := portKey(boxTap, boxMAC, boxIP)
	if err != nil {
		t.Fatal(err)
	}
	ipv6 := make([]byte, 40)
	ipv6[0] = 0x60
	return boxFrames{set: map[string]bool{"ports/" + string(k): true}, own: ipv4(boxIP, netip.MustParseAddr("172.30.0.1"), unix.IPPROTO_UDP),
		ipv6: ipv6, bridgeMAC: "fe:54:00:00:00:01"}
}

// Every path by which a frame of a box reaches the host's kernel meets one
// of kvbox's chains that drops what a box may not send: the bridge's
// forwarding path (prerouting), the bridge's local path for the reserved
// link-local group addresses (the bridge family's input hook, the tap as
// input device: TestPortFilterReservedGroups), and the tap's own IP and
// ARP stacks (the inet and arp families, the tap as device:
// TestPortFilterTapStacks). What a box may send (IPv4 and ARP of its own,
// passed up by the bridge to the host) still passes, and nothing of any
// other device is touched.
func TestPortFilterClosesEveryPath(t *testing.T) {
	b := newBoxFrames(t)
	own, ipv6, bridgeMAC := b.own, b.ipv6, b.bridgeMAC
	pre, in := bridgePre, bridgeIn
	post := hookAt{nftables.TableFamilyBridge, *nftables.ChainHookPostrouting, "bridge postrouting"}
	for _, tc := range []struct {
		name string
		at   hookAt
		p    hookPacket
		want string
	}{
		{"own IPv4 to the bridge, forwarding path", pre, hookPacket{iif: boxTap, frame: frame(bridgeMAC, boxMAC, unix.ETH_P_IP, own)}, "accept"},
		{"own IPv4 to the bridge, passed up to the host", in, hookPacket{iif: boxTap, frame: frame(bridgeMAC, boxMAC, unix.ETH_P_IP, own)}, "accept"},
		{"own IPv4 broadcast", pre, hookPacket{iif: boxTap, frame: frame("ff:ff:ff:ff:ff:ff", boxMAC, unix.ETH_P_IP, own)}, "accept"},
		{"own IPv4 to a multicast MAC past the reserved ones", pre, hookPacket{iif: boxTap, frame: frame("01:80:c2:00:00:10", boxMAC, unix.ETH_P_IP, own)}, "accept"},
		{"spoofed MAC", pre, hookPacket{iif: boxTap, frame: frame(bridgeMAC, spoofed, unix.ETH_P_IP, own)}, "drop"},
		{"IPv6", pre, hookPacket{iif: boxTap, frame: frame("33:33:00:00:00:01", boxMAC, unix.ETH_P_IPV6, ipv6)}, "drop"},
		{"another device's link-local frame", in, hookPacket{iif: "eth0", frame: frame("01:80:c2:00:00:03", spoofed, unix.ETH_P_IP, own)}, "accept"},
		{"the host's frame to a box", post, hookPacket{oif: boxTap, frame: frame(boxMAC, bridgeMAC, unix.ETH_P_IP, own)}, "accept"},
		{"the host's IPv6 to a box", post, hookPacket{oif: boxTap, frame: frame(boxMAC, bridgeMAC, unix.ETH_P_IPV6, ipv6)}, "drop"},
	} {
		if got := verdictAt(t, tc.at.fam, tc.at.hook, tc.p, b.set); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
}

// The reserved link-local group addresses, carrying the box's own IPv4:
// forwarded (group_fwd_mask) they meet prerouting, kept local the bridge's
// input hook; either drops them.
func TestPortFilterReservedGroups(t *testing.T) {
	b := newBoxFrames(t)
	for i := 0; i < 16; i++ {
		dst := fmt.Sprintf("01:80:c2:00:00:%02x", i)
		for _, at := range []hookAt{bridgePre, bridgeIn} {
			p := hookPacket{iif: boxTap, frame: frame(dst, boxMAC, unix.ETH_P_IP, b.own)}
			if got := verdictAt(t, at.fam, at.hook, p, b.set); got != "drop" {
				t.Errorf("a box's IPv4 to %s at %s: %s", dst, at.name, got)
			}
		}
	}
	if groupFwdMask&0x4000 == 0 || groupFwdMask&0x7 != 0 {
		t.Errorf("group_fwd_mask %#x: LLDP (0e) must be forwarded (the kernel runs no hook on its local path); 00-02 cannot be", groupFwdMask)
	}
}

// The tap's own stacks: nothing in, nothing out; the bridges (also named
// kvb*) and other devices untouched.
func TestPortFilterTapStacks(t *testing.T) {
	b := newBoxFrames(t)
	inet, arp := nftables.TableFamilyINet, nftables.TableFamilyARP
	for _, tc := range []struct {
		dev, kind string
		want      string
	}{
		{boxTap, "tun", "drop"},
		{"kvbox0", "bridge", "accept"},
		{GroupBridge("web"), "bridge", "accept"},
		{"eth0", "", "accept"},
		{"kvbtap", "veth", "accept"},
	} {
		for _, at := range []hookAt{{inet, *nftables.ChainHookInput, "inet input"}, {inet, *nftables.ChainHookForward, "inet forward"}, {arp, nfARPIn, "arp input"}} {
			p := hookPacket{iif: tc.dev, iifKind: tc.kind, oif: "eth0", frame: frame(b.bridgeMAC, boxMAC, unix.ETH_P_IP, b.own)}
			if got := verdictAt(t, at.fam, at.hook, p, b.set); got != tc.want {
				t.Errorf("from %s (%s) at %s: %s, want %s", tc.dev, tc.kind, at.name, got, tc.want)
			}
		}
		for _, at := range []hookAt{{inet, *nftables.ChainHookOutput, "inet output"}, {inet, *nftables.ChainHookForward, "inet forward"}, {arp, nfARPOut, "arp output"}} {
			p := hookPacket{iif: "eth0", oif: tc.dev, oifKind: tc.kind, frame: frame(boxMAC, b.bridgeMAC, unix.ETH_P_IP, b.own)}
			if got := verdictAt(t, at.fam, at.hook, p, b.set); got != tc.want {
				t.Errorf("to %s (%s) at %s: %s, want %s", tc.dev, tc.kind, at.name, got, tc.want)
			}
		}
	}
}

// A box with no route out (offline): its IPv4 goes nowhere the host would
// route it, its ARP and what its bridge forwards to a groupmate still
// pass; a box that is not offline is untouched.
func TestPortFilterOffline(t *testing.T) {
	k, err := portKey(boxTap, boxMAC, boxIP)
	if err != nil {
		t.Fatal(err)
	}
	ok, err := offlineKey(boxTap)
	if err != nil {
		t.Fatal(err)
	}
	online := map[string]bool{"ports/" + string(k): true}
	offline := map[string]bool{"ports/" + string(k): true, "offline/" + string(ok): true}
	gw, mate := netip.MustParseAddr("172.30.0.1"), netip.MustParseAddr("172.30.0.8")
	out := frame("fe:54:00:00:00:01", boxMAC, unix.ETH_P_IP, ipv4(boxIP, netip.MustParseAddr("203.0.113.10"), unix.IPPROTO_TCP))
	toGW := frame("fe:54:00:00:00:01", boxMAC, unix.ETH_P_IP, ipv4(boxIP, gw, unix.IPPROTO_UDP))
	toMate := frame("52:54:00:ab:cd:0f", boxMAC, unix.ETH_P_IP, ipv4(boxIP, mate, unix.IPPROTO_TCP))
	arpReq := frame("ff:ff:ff:ff:ff:ff", boxMAC, unix.ETH_P_ARP, arpPayload(boxMAC, boxIP, gw))
	br := nftables.TableFamilyBridge
	in, pre := *nftables.ChainHookInput, *nftables.ChainHookPrerouting
	for _, tc := range []struct {
		name string
		hook nftables.ChainHook
		f    []byte
		set  map[string]bool
		want string
	}{
		{"offline: IPv4 to be routed out", in, out, offline, "drop"},
		{"offline: IPv4 to the gateway", in, toGW, offline, "drop"},
		{"offline: ARP for the gateway", in, arpReq, offline, "accept"},
		{"offline: IPv4 to a groupmate, forwarded", pre, toMate, offline, "accept"},
		{"online: IPv4 to be routed out", in, out, online, "accept"},
		{"online: IPv4 to a groupmate", pre, toMate, online, "accept"},
	} {
		if got := verdictAt(t, br, tc.hook, hookPacket{iif: boxTap, frame: tc.f}, tc.set); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
}

// arpPayload is an Ethernet/IPv4 ARP request from mac and ip for target.
func arpPayload(mac string, ip, target netip.Addr) []byte {
	hw, _ := net.ParseMAC(mac)
	p := []byte{0, 1, 8, 0, 6, 4, 0, 1}
	p = append(p, hw...)
	a, b := ip.As4(), target.As4()
	p = append(p, a[:]...)
	p = append(p, make([]byte, 6)...)
	return append(p, b[:]...)
}
