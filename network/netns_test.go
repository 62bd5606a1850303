package network

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/testenv/gate"
)

// nsChildEnv names the test a child process runs inside its own namespaces
// (inNamespaces).
const nsChildEnv = "KVBOX_TEST_NAMESPACE_CHILD"

// inNamespaces runs the calling test again in a child process made in a
// fresh network and mount namespace, with a /run of its own, so that
// kvbox's real bridge, tables and lock files are the child's only. It
// returns true in the child, where the test's body runs; in the parent it
// waits for the child, fails the test with its output unless the child ran
// the test and passed, and returns false.
func inNamespaces(t *testing.T) bool {
	t.Helper()
	if os.Getenv(nsChildEnv) == t.Name() {
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			t.Fatalf("make / private in the child's mount namespace: %v", err)
		}
		if err := unix.Mount("tmpfs", "/run", "tmpfs", 0, ""); err != nil {
			t.Fatalf("a /run of the child's own: %v", err)
		}
		return true
	}
	gate.Root(t) // for the namespaces
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), nsChildEnv+"="+t.Name())
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET | syscall.CLONE_NEWNS}
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: "+t.Name()) {
		t.Fatalf("%s in its own namespaces: %v\n%s", t.Name(), err, out)
	}
	return false
}

// kvboxChains lists the chains of kvbox's tables in this namespace, by
// chainKey.
func kvboxChains(t *testing.T) map[string]bool {
	t.Helper()
	conn, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	chains, err := conn.ListChains()
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, c := range chains {
		if c.Table.Name == tableName {
			have[chainKey(c)] = true
		}
	}
	return have
}

// kvbox's tables, made on a host without them, made again whole after a
// reboot or when part of one is gone (the bridge table then says it is
// new: its caller puts every box back); removed with the last box.
func TestEnsurePortFilter(t *testing.T) {
	if !inNamespaces(t) {
		return
	}
	all := len(append(portChains(portSet(filterTable())), tapStackChains()...))
	created, err := EnsurePortFilter()
	if err != nil || !created {
		t.Fatalf("first EnsurePortFilter: created %v, %v", created, err)
	}
	if have := kvboxChains(t); len(have) != all {
		t.Fatalf("chains after the first EnsurePortFilter: %v", have)
	}
	if created, err := EnsurePortFilter(); err != nil || created {
		t.Fatalf("second EnsurePortFilter: created %v, %v", created, err)
	}
	ip := netip.MustParseAddr("172.30.0.9")
	if err := AllowPort(TapName("52:54:00:00:00:09"), "52:54:00:00:00:09", ip, true); err != nil {
		t.Fatal(err)
	}
	if n := offlineTaps(t); n != 1 {
		t.Errorf("an offline box's tap: %d elements in the offline set", n)
	}

	conn, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	for what, del := range map[string]func(){
		"the to-host chain": func() { conn.DelChain(&nftables.Chain{Table: filterTable(), Name: "to-host"}) },
		"the offline set": func() {
			conn.FlushChain(&nftables.Chain{Table: filterTable(), Name: "to-host"})
			conn.DelSet(offlineSet(filterTable()))
		},
	} {
		partialBridgeTable(t, conn, all, what, del)
		if err := AllowPort(TapName("52:54:00:00:00:09"), "52:54:00:00:00:09", ip, true); err != nil {
			t.Fatal(err)
		}
	}
	// Part of the inet table: made again whole.
	conn.DelChain(&nftables.Chain{Table: &nftables.Table{Family: nftables.TableFamilyINet, Name: tableName}, Name: "output"})
	if err := conn.Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := EnsurePortFilter(); err != nil {
		t.Fatal(err)
	}
	if have := kvboxChains(t); len(have) != all {
		t.Errorf("chains after completing the inet table: %v", have)
	}

	if err := removePortFilter(); err != nil || len(kvboxChains(t)) != all {
		t.Errorf("removed with a box in the filter: %v, %v", err, kvboxChains(t))
	}
	if err := AllowPort(TapName("52:54:00:00:00:09"), "52:54:00:00:00:09", ip, true); err != nil {
		t.Fatal(err)
	}
	if err := ForgetPort(TapName("52:54:00:00:00:09"), "52:54:00:00:00:09", ip); err != nil {
		t.Fatal(err)
	}
	if n := offlineTaps(t); n != 0 {
		t.Errorf("a forgotten box's tap left in the offline set (%d)", n)
	}
	if err := removePortFilter(); err != nil || len(kvboxChains(t)) != 0 {
		t.Errorf("left after the last box: %v, %v", err, kvboxChains(t))
	}
}

// offlineTaps is how many taps the offline set holds.
func offlineTaps(t *testing.T) int {
	t.Helper()
	c, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	set, err := c.GetSetByName(filterTable(), "offline")
	if err != nil {
		t.Fatalf("the offline set: %v", err)
	}
	els, err := c.GetSetElements(set)
	if err != nil {
		t.Fatal(err)
	}
	return len(els)
}

// toHostRulesOK checks that the to-host chain holds kvbox's rules.
func toHostRulesOK(t *testing.T, conn *nftables.Conn, after string) {
	t.Helper()
	rules, err := conn.GetRules(filterTable(), &nftables.Chain{Table: filterTable(), Name: "to-host"})
	if err != nil || len(rules) != len(toHostRules(offlineSet(filterTable()))) {
		t.Errorf("to-host after %s: %d rules, %v", after, len(rules), err)
	}
}

// partialBridgeTable: a bridge table with a part deleted (del) is made
// again whole, with kvbox's rules in every chain, and no box in it.
func partialBridgeTable(t *testing.T, conn *nftables.Conn, all int, what string, del func()) {
	t.Helper()
	del()
	if err := conn.Flush(); err != nil {
		t.Fatal(err)
	}
	if created, err := EnsurePortFilter(); err != nil || !created {
		t.Fatalf("EnsurePortFilter without %s: created %v, %v", what, created, err)
	}
	if have := kvboxChains(t); len(have) != all {
		t.Errorf("chains after making the table without %s again: %v", what, have)
	}
	rules, err := conn.GetRules(filterTable(), &nftables.Chain{Table: filterTable(), Name: "from-boxes"})
	if err != nil || len(rules) != len(fromBoxRules(portSet(filterTable()))) {
		t.Errorf("from-boxes after making the table without %s again: %d rules, %v", what, len(rules), err)
	}
	set, err := conn.GetSetByName(filterTable(), "ports")
	if err != nil {
		t.Fatal(err)
	}
	if els, err := conn.GetSetElements(set); err != nil || len(els) != 0 {
		t.Errorf("ports in the table made again without %s: %d elements, %v", what, len(els), err)
	}
	if n := offlineTaps(t); n != 0 {
		t.Errorf("the offline set made again without %s: %d elements", what, n)
	}
	toHostRulesOK(t, conn, "making the table without "+what+" again")
}

// A bridge kvbox makes forwards the link-local group addresses it may
// before any port is on it, and one that was there already gets the same; a
// group's bridge is marked with its group's name and refused to another
// group.
func TestBridgeSetUp(t *testing.T) {
	if !inNamespaces(t) {
		return
	}
	mask := func(name string) uint16 {
		t.Helper()
		l, err := netlink.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		b, ok := l.(*netlink.Bridge)
		if !ok || b.GroupFwdMask == nil {
			t.Fatalf("%s: %T without group_fwd_mask", name, l)
		}
		return *b.GroupFwdMask
	}
	c, err := Parse("kvbt0", "172.30.40.0/24")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ensure(false); err != nil {
		t.Fatal(err)
	}
	if m := mask(c.Bridge); m != groupFwdMask {
		t.Errorf("a new bridge's group_fwd_mask: %#x", m)
	}
	old := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "kvbt1"}}
	if err := netlink.LinkAdd(old); err != nil {
		t.Fatal(err)
	}
	c1, _ := Parse("kvbt1", "172.30.41.0/24")
	if err := c1.ensure(false); err != nil {
		t.Fatal(err)
	}
	if m := mask("kvbt1"); m != groupFwdMask {
		t.Errorf("a bridge that was there already: group_fwd_mask %#x", m)
	}

	web := GroupConfig("web", GroupBridge("web"), netip.MustParsePrefix("172.30.42.0/24"))
	if err := web.ensure(false); err != nil {
		t.Fatal(err)
	}
	if l, _ := netlink.LinkByName(web.Bridge); l == nil || l.Attrs().Alias != "kvbox group web" {
		t.Fatalf("group web's bridge is not marked: %+v", l)
	}
	if err := web.ensure(false); err != nil {
		t.Errorf("group web's bridge, again: %v", err)
	}
	// Another group whose bridge name came out the same.
	db := GroupConfig("db", web.Bridge, netip.MustParsePrefix("172.30.43.0/24"))
	if err := db.ensure(false); err == nil || !strings.Contains(err.Error(), "group web") {
		t.Errorf("group db on group web's bridge: %v", err)
	}
	addrs, _ := netlink.AddrList(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: web.Bridge}}, netlink.FAMILY_V4)
	for _, a := range addrs {
		if a.IP.String() == db.Gateway().String() {
			t.Errorf("group db's gateway was put on group web's bridge")
		}
	}
}

// A subnet another link of the namespace routes is refused, naming the
// link, and the bridge made for it goes again; a broader route, and the
// bridge's own subnet set up again, are no clash.
func TestBridgeSubnetTaken(t *testing.T) {
	if !inNamespaces(t) {
		return
	}
	other := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "otherbr0"}}
	if err := netlink.LinkAdd(other); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(other); err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("172.30.50.1/24")
	if err := netlink.AddrAdd(other, addr); err != nil {
		t.Fatal(err)
	}
	for _, sub := range []string{"172.30.50.0/24", "172.30.0.0/16"} {
		c, err := Parse("kvbt0", sub)
		if err != nil {
			t.Fatal(err)
		}
		err = c.ensure(false)
		if err == nil || !strings.Contains(err.Error(), "otherbr0") {
			t.Errorf("subnet %s, routed to otherbr0: %v", sub, err)
		}
		if _, err := netlink.LinkByName("kvbt0"); err == nil {
			t.Errorf("subnet %s: the refused bridge was left behind", sub)
		}
	}
	// A broader route, as a VPN's, loses the subnet to the bridge.
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: other.Attrs().Index, Dst: &net.IPNet{IP: net.IPv4(10, 0, 0, 0), Mask: net.CIDRMask(8, 32)}}); err != nil {
		t.Fatal(err)
	}
	c, _ := Parse("kvbt0", "10.1.2.0/24")
	for i := 0; i < 2; i++ {
		if err := c.ensure(false); err != nil {
			t.Fatalf("a free subnet (time %d): %v", i+1, err)
		}
	}
}

// A port added after another kvbox removed the filter with its last port
// says so (ErrNoPortFilter) instead of failing as any error; the filter
// made again takes it; a filter holding a port is not removed.
func TestAllowPortAfterFilterRemoved(t *testing.T) {
	if !inNamespaces(t) {
		return
	}
	if _, err := EnsurePortFilter(); err != nil {
		t.Fatal(err)
	}
	if err := removePortFilter(); err != nil {
		t.Fatal(err)
	}
	ip := netip.MustParseAddr("172.30.60.2")
	mac := "52:54:00:aa:bb:01"
	if err := AllowPort(TapName(mac), mac, ip, false); !errors.Is(err, ErrNoPortFilter) {
		t.Fatalf("a port with no filter: %v, want ErrNoPortFilter", err)
	}
	if _, err := EnsurePortFilter(); err != nil {
		t.Fatal(err)
	}
	if err := AllowPort(TapName(mac), mac, ip, false); err != nil {
		t.Fatalf("a port once the filter is made again: %v", err)
	}
	if err := removePortFilter(); err != nil {
		t.Fatal(err)
	}
	if len(kvboxChains(t)) == 0 {
		t.Error("the filter went with a port in it")
	}
}

// A group's subnet is the first /24 of GroupPool that neither the subnets
// taken nor a route of the namespace overlaps.
func TestGroupSubnetAvoidsRoutes(t *testing.T) {
	if !inNamespaces(t) {
		return
	}
	other := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "otherbr1"}}
	if err := netlink.LinkAdd(other); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(other); err != nil {
		t.Fatal(err)
	}
	addr, _ := netlink.ParseAddr("172.30.1.1/24")
	if err := netlink.AddrAdd(other, addr); err != nil {
		t.Fatal(err)
	}
	got, err := GroupSubnet([]netip.Prefix{netip.MustParsePrefix("172.30.2.0/24")})
	if err != nil || got != netip.MustParsePrefix("172.30.3.0/24") {
		t.Errorf("GroupSubnet with 172.30.1.0/24 routed and 172.30.2.0/24 taken: %v %v, want 172.30.3.0/24", got, err)
	}
}
