package network

import (
	"bytes"
	"crypto/sha256"
	"net/netip"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
)

func TestAllocate(t *testing.T) {
	c := Default
	a, err := c.Allocate(nil)
	if err != nil || a != netip.MustParseAddr("172.30.0.2") {
		t.Fatalf("first allocation = %v, %v; want 172.30.0.2", a, err)
	}
	a, err = c.Allocate([]netip.Addr{netip.MustParseAddr("172.30.0.2"), netip.MustParseAddr("172.30.0.4")})
	if err != nil || a != netip.MustParseAddr("172.30.0.3") {
		t.Fatalf("allocation with holes = %v, %v; want 172.30.0.3", a, err)
	}
	small, err := Parse("kvt0", "10.9.0.0/29")
	if err != nil {
		t.Fatal(err)
	}
	var used []netip.Addr
	for i := 0; i < 5; i++ { // .2 .. .6; .1 is the gateway, .7 broadcast
		a, err := small.Allocate(used)
		if err != nil {
			t.Fatalf("allocation %d: %v", i, err)
		}
		used = append(used, a)
	}
	if a, err := small.Allocate(used); err == nil {
		t.Fatalf("full subnet handed out %v", a)
	}
	if n := small.Addresses(); n != len(used) {
		t.Fatalf("Addresses of %s = %d, Allocate handed out %d", small.Subnet, n, len(used))
	}
	if n := Default.Addresses(); n != 253 {
		t.Fatalf("Addresses of %s = %d, want 253", Default.Subnet, n)
	}
}

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		bridge, subnet string
		ok             bool
	}{
		{"kvbox0", "172.30.0.0/24", true},
		{"kvbox0", "172.30.0.7/24", true},
		{"kvbox0", "fd00::/64", false},
		{"kvbox0", "172.30.0.0/30", false},
		{"kvbox0", "nonsense", false},
		{"", "172.30.0.0/24", false},
		{"a-very-long-bridge-name", "172.30.0.0/24", false},
		{"a/b", "172.30.0.0/24", false},
	} {
		_, err := Parse(tc.bridge, tc.subnet)
		if (err == nil) != tc.ok {
			t.Errorf("Parse(%q, %q) error = %v, want ok=%v", tc.bridge, tc.subnet, err, tc.ok)
		}
	}
}

func TestNewMAC(t *testing.T) {
	a, b := NewMAC(), NewMAC()
	if a == b || len(a) != 17 || a[:9] != "52:54:00:" {
		t.Fatalf("NewMAC gave %q and %q", a, b)
	}
}

// kvbox's rules are written as iptables -S prints them (seen on iptables
// 1.8.9): one listing tells whether a chain is right, and a chain that is
// right is never flushed.
func TestRulesAsIptablesPrintsThem(t *testing.T) {
	c := Default
	got := []string{}
	for _, s := range c.fwdRules([]netip.Addr{netip.MustParseAddr("10.255.255.53")})[:5] {
		got = append(got, line(c.fwdChain(), s))
	}
	for _, j := range c.jumps() {
		got = append(got, line(j.chain, j.spec))
	}
	m := c.masquerade("0")
	got = append(got, line(m.chain, m.spec))
	want := []string{
		"-A KVBOX-FWD-kvbox0 -i kvbox0 -o kvbox0 -j ACCEPT",
		"-A KVBOX-FWD-kvbox0 -o kvbox0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
		"-A KVBOX-FWD-kvbox0 -o kvbox0 -j DROP",
		"-A KVBOX-FWD-kvbox0 -s 172.30.0.0/24 -d 10.255.255.53/32 -i kvbox0 -p udp -m udp --dport 53 -j ACCEPT",
		"-A KVBOX-FWD-kvbox0 -s 172.30.0.0/24 -d 10.255.255.53/32 -i kvbox0 -p tcp -m tcp --dport 53 -j ACCEPT",
		`-A INPUT -i kvbox0 -m comment --comment "kvbox kvbox0" -j KVBOX-IN-kvbox0`,
		`-A FORWARD -i kvbox0 -m comment --comment "kvbox kvbox0" -j KVBOX-FWD-kvbox0`,
		`-A FORWARD -o kvbox0 -m comment --comment "kvbox kvbox0" -j KVBOX-FWD-kvbox0`,
		`-A POSTROUTING -s 172.30.0.0/24 ! -o kvbox0 -m comment --comment "kvbox kvbox0 ip_forward=0" -j MASQUERADE`,
	}
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			t.Errorf("rule %d:\n got %q\nwant %q", i, got[i], want[i])
		}
	}
	if n := len(c.fwdRules(nil)); n != 3+len(Blocked)+2 {
		t.Errorf("%d forward rules without resolvers", n)
	}
}

// A box's tap is named after its MAC, within IFNAMSIZ; its port key is the
// tap, the MAC and the address, each padded to 4 bytes as the registers the
// rule loads them into.
func TestPortKey(t *testing.T) {
	tap := TapName("52:54:00:AB:cd:0e")
	if tap != "kvb525400abcd0e" || len(tap) > 15 {
		t.Fatalf("TapName = %q", tap)
	}
	k, err := portKey(tap, "52:54:00:ab:cd:0e", netip.MustParseAddr("172.30.0.7"))
	if err != nil {
		t.Fatal(err)
	}
	want := append([]byte("kvb525400abcd0e\x00"), 0x52, 0x54, 0, 0xab, 0xcd, 0x0e, 0, 0, 172, 30, 0, 7)
	if !bytes.Equal(k, want) || len(k) != int(portKeyType.Bytes) {
		t.Fatalf("portKey = %x, want %x", k, want)
	}
	for _, bad := range []struct {
		tap, mac, ip string
	}{
		{tap, "not-a-mac", "172.30.0.7"},
		{tap, "52:54:00:ab:cd:0e", "fd00::7"},
		{"a-device-name-too-long", "52:54:00:ab:cd:0e", "172.30.0.7"},
	} {
		if _, err := portKey(bad.tap, bad.mac, netip.MustParseAddr(bad.ip)); err == nil {
			t.Errorf("portKey(%q, %q, %s) = nil error", bad.tap, bad.mac, bad.ip)
		}
	}
}

// Two groups never share a bridge. The first 32 bits of these two names'
// SHA-256 agree (found by trying names in turn): a bridge name of 32 bits
// would be one for both; now each has its own, within IFNAMSIZ.
func TestGroupBridgeNames(t *testing.T) {
	a, b := "group-22235", "group-30796"
	sa, sb := sha256.Sum256([]byte(a)), sha256.Sum256([]byte(b))
	if !bytes.Equal(sa[:4], sb[:4]) {
		t.Fatalf("the first 32 bits of the names' hashes differ (%x, %x): the pair shows nothing", sa[:4], sb[:4])
	}
	if GroupBridge(a) == GroupBridge(b) {
		t.Errorf("groups %q and %q share bridge %s", a, b, GroupBridge(a))
	}
	for _, g := range []string{a, b, "web", "x"} {
		br := GroupBridge(g)
		if len(br) != 15 || !strings.HasPrefix(br, GroupBridgePrefix) || strings.Trim(br[4:], "abcdefghijklmnopqrstuvwxyz234567") != "" {
			t.Errorf("GroupBridge(%q) = %q", g, br)
		}
		if br != GroupBridge(g) {
			t.Errorf("GroupBridge(%q) = %q", g, br)
		}
	}
}

// A group's bridge marked as another group's is refused with one line; one
// marked as its own is taken.
func TestGroupBridgeClaim(t *testing.T) {
	c := GroupConfig("web", GroupBridge("web"), netip.MustParsePrefix("172.30.5.0/24"))
	mine := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: c.Bridge, Alias: "kvbox group web"}}
	if err := c.claim(mine); err != nil {
		t.Errorf("its own bridge: %v", err)
	}
	other := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: c.Bridge, Alias: "kvbox group db"}}
	err := c.claim(other)
	if err == nil || !strings.Contains(err.Error(), `group "web"`) || !strings.Contains(err.Error(), "group db") || strings.Contains(err.Error(), "\n") {
		t.Errorf("another group's bridge: %v", err)
	}
	if err := Default.claim(other); err != nil {
		t.Errorf("the main bridge is no group's: %v", err)
	}
}
