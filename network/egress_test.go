package network

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
)

func testRules(proxy bool) EgressRules {
	return EgressRules{Own: netip.MustParsePrefix("172.30.0.0/24"), Gateway: netip.MustParseAddr("172.30.0.1"),
		Allow: []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")},
		Deny:  []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("198.51.100.0/24")}, Proxy: proxy,
		Ports: EgressPorts{HTTP: 20000, TLS: 20001, DNS: 20002}}
}

// The chains a policy makes: its own bridge first, allow before deny, DNS
// always to the resolver, the web ports of denied addresses to the proxy
// only where names are allowed.
func TestEgressChainRules(t *testing.T) {
	for _, proxy := range []bool{false, true} {
		rules, err := egressChainRules(testRules(proxy))
		if err != nil {
			t.Fatal(err)
		}
		fwd, nat := rules[0], rules[1]
		if len(fwd) != 4 {
			t.Fatalf("forward rules: %d, want own + 1 allow + 2 deny", len(fwd))
		}
		if v := fwd[0][len(fwd[0])-1].(*expr.Verdict); v.Kind != expr.VerdictReturn {
			t.Errorf("first forward rule %v: not its own bridge's return", v)
		}
		if v := fwd[1][len(fwd[1])-1].(*expr.Verdict); v.Kind != expr.VerdictAccept {
			t.Errorf("allow rule ends in %v", v)
		}
		for _, r := range fwd[2:] {
			if v := r[len(r)-1].(*expr.Verdict); v.Kind != expr.VerdictDrop {
				t.Errorf("deny rule ends in %v", v)
			}
			if !slices.ContainsFunc(r, func(e expr.Any) bool { _, ok := e.(*expr.Counter); return ok }) {
				t.Error("a deny rule without a counter (egress show reports it)")
			}
		}
		// 0.0.0.0/0 matches everything: mask 0.
		if b := fwd[2][1].(*expr.Bitwise); !slices.Equal(b.Mask, []byte{0, 0, 0, 0}) {
			t.Errorf("0.0.0.0/0's mask %v", b.Mask)
		}
		if b := fwd[3][1].(*expr.Bitwise); !slices.Equal(b.Mask, []byte{255, 255, 255, 0}) {
			t.Errorf("/24's mask %v", b.Mask)
		}
		redirects := 0
		for _, r := range nat {
			if slices.ContainsFunc(r, func(e expr.Any) bool { _, ok := e.(*expr.Redir); return ok }) {
				redirects++
			}
		}
		want := 4 // DNS to the gateway and to anywhere, UDP and TCP
		if proxy {
			want += 4 // 443 and 80 of each denied CIDR
		}
		if redirects != want {
			t.Errorf("proxy %v: %d redirects, want %d", proxy, redirects, want)
		}
	}
	if _, err := egressChainRules(EgressRules{}); err == nil {
		t.Error("rules without the box's subnet made")
	}
	noPorts := testRules(true)
	noPorts.Ports = EgressPorts{}
	if _, err := egressChainRules(noPorts); err == nil {
		t.Error("rules without the state dir's proxy ports made")
	}
}

// A box's rules are set, replaced whole and removed in one batch each;
// a table partly gone is made again and says so.
func TestSetEgress(t *testing.T) {
	if !inNamespaces(t) {
		return
	}
	created, err := EnsureEgress()
	if err != nil || !created {
		t.Fatalf("first EnsureEgress: %v %v", created, err)
	}
	if created, err := EnsureEgress(); err != nil || created {
		t.Fatalf("second EnsureEgress: %v %v", created, err)
	}
	box := netip.MustParseAddr("172.30.0.9")
	r := testRules(true)
	if err := SetEgress(box, &r); err != nil {
		t.Fatal(err)
	}
	conn, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	fname, nname := egressChainNames(box)
	count := func(chain string) int {
		rs, err := conn.GetRules(egressTable(), &nftables.Chain{Name: chain, Table: egressTable()})
		if err != nil {
			return -1
		}
		return len(rs)
	}
	elements := func(set string) int {
		s, err := conn.GetSetByName(egressTable(), set)
		if err != nil {
			t.Fatal(err)
		}
		els, err := conn.GetSetElements(s)
		if err != nil {
			t.Fatal(err)
		}
		return len(els)
	}
	if count(fname) != 4 || count(nname) != 6+4 || elements("fwd") != 1 || elements("nat") != 1 || !HasEgress(box) {
		t.Fatalf("after SetEgress: %d/%d rules, %d/%d elements", count(fname), count(nname), elements("fwd"), elements("nat"))
	}
	// Set again with other rules: replaced, not added to.
	r2 := EgressRules{Own: r.Own, Gateway: r.Gateway, Deny: []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24")}, Ports: r.Ports}
	if err := SetEgress(box, &r2); err != nil {
		t.Fatal(err)
	}
	if count(fname) != 2 || count(nname) != 5 || elements("fwd") != 1 {
		t.Fatalf("after a second SetEgress: %d/%d rules, %d elements", count(fname), count(nname), elements("fwd"))
	}
	if n, err := EgressDropped(box); err != nil || n != 0 {
		t.Errorf("EgressDropped: %d %v", n, err)
	}
	if err := SetEgress(box, nil); err != nil {
		t.Fatal(err)
	}
	if elements("fwd") != 0 || elements("nat") != 0 || HasEgress(box) {
		t.Fatalf("after removal: %d rules, %d elements", count(fname), elements("fwd"))
	}
	if err := SetEgress(box, nil); err != nil {
		t.Fatalf("removing rules that are not there: %v", err)
	}
	// Part of the table gone: made again whole, and new.
	conn.DelChain(&nftables.Chain{Table: egressTable(), Name: "prerouting"})
	if err := conn.Flush(); err != nil {
		t.Fatal(err)
	}
	if created, err := EnsureEgress(); err != nil || !created {
		t.Fatalf("EnsureEgress after a chain went: %v %v", created, err)
	}
	if err := SetEgress(box, &r); err != nil {
		t.Fatal(err)
	}
	// It goes with the port filter's tables.
	if _, err := EnsurePortFilter(); err != nil {
		t.Fatal(err)
	}
	if err := removePortFilter(); err != nil {
		t.Fatal(err)
	}
	if tables, _ := conn.ListTablesOfFamily(nftables.TableFamilyIPv4); slices.ContainsFunc(tables, func(x *nftables.Table) bool { return x.Name == egressTableName }) {
		t.Error("the egress table stays after the port filter's tables went")
	}
}
