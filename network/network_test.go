package network

import (
	"net/netip"
	"testing"
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
