//go:build e2e

package testenv

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
)

// hostPing checks that the host side of the bridge (this namespace)
// reaches a box.
func hostPing(t *testing.T, ip string) {
	t.Helper()
	if out, err := exec.Command("ping", "-c", "1", "-W", "5", ip).CombinedOutput(); err != nil {
		t.Errorf("ping %s from the namespace: %v\n%s", ip, err, out)
	}
}

// isoNet is a kvbox bridge of this test's own with NAT to an "internet"
// namespace, so no other test's bridge or firewall is touched.
type isoNet struct {
	br, sub, gw string
	flags       []string // --bridge and --subnet for kvbox
}

const (
	inetAddr    = "203.0.113.10"    // the "internet" server (a documentation range)
	privateAddr = "10.99.0.10"      // a private-range server beyond the bridge
	metaAddr    = "169.254.169.254" // a cloud's metadata service
	hostPort    = "8081"            // a server of the host on the bridge's address
)

// setupIsoNet makes the bridge (network up --nat) and, beside this
// namespace, a namespace that answers HTTP on inetAddr, privateAddr and
// metaAddr, reached over a veth pair (192.0.2.0/24, nothing leaves the
// test's namespaces). It has no route back to the bridge's subnet: only
// NAT'd traffic gets answers. The host listens on the gateway address.
func setupIsoNet(t *testing.T) isoNet {
	t.Helper()
	id := strings.TrimPrefix(runID, "e2e")
	sub := netip.MustParsePrefix(freeSubnet(t))
	n := isoNet{br: "kvi" + id, sub: sub.String(), gw: sub.Addr().Next().String()}
	n.flags = []string{"--bridge", n.br, "--subnet", n.sub}
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	ns := "kvbox-inet-" + runID
	run("ip", "netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	in := func(args ...string) { t.Helper(); run(append([]string{"ip", "netns", "exec", ns}, args...)...) }
	up, peer := "kvu"+id, "kvp"+id
	run("ip", "link", "add", up, "type", "veth", "peer", "name", peer, "netns", ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", up).Run() })
	run("ip", "addr", "add", "192.0.2.1/24", "dev", up)
	run("ip", "link", "set", up, "up")
	in("ip", "link", "set", "lo", "up")
	in("ip", "addr", "add", "192.0.2.2/24", "dev", peer)
	in("ip", "link", "set", peer, "up")
	for _, a := range []string{inetAddr, privateAddr, metaAddr} {
		in("ip", "addr", "add", a+"/32", "dev", "lo")
		run("ip", "route", "replace", a+"/32", "via", "192.0.2.2", "dev", up)
	}
	www := t.TempDir()
	os.WriteFile(filepath.Join(www, "index.html"), []byte("beyond\n"), 0o644)
	os.Chmod(www, 0o755)
	httpd := exec.Command("ip", "netns", "exec", ns, "busybox", "httpd", "-f", "-p", "80", "-h", www)
	if err := httpd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { httpd.Process.Kill(); httpd.Wait() })

	t.Cleanup(func() { kvbox(t, append(n.flags, "network", "rm")...) })
	var st struct{ Present, NAT, Firewall bool }
	if err := json.Unmarshal([]byte(mustKvbox(t, append(n.flags, "network", "up", "--nat", "--json")...)), &st); err != nil {
		t.Fatal(err)
	}
	if !st.Present || !st.NAT || !st.Firewall {
		t.Fatalf("network up --nat: %+v", st)
	}
	l, err := net.Listen("tcp", n.gw+":"+hostPort)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "host") })}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	// Each server answers from here: a box that cannot reach one is held
	// back by kvbox's rules, not by a broken test bench.
	eventually(t, 10*time.Second, func() error {
		for _, u := range []string{"http://" + inetAddr + "/", "http://" + privateAddr + "/", "http://" + metaAddr + "/", "http://" + n.gw + ":" + hostPort + "/"} {
			if _, err := httpGet(u); err != nil {
				return err
			}
		}
		return nil
	})
	return n
}

// clone snapshots box src (snapshot BASEsnap) and starts a clone of it
// (BASEclone) on this network; both go when the test ends.
func (n isoNet) clone(t *testing.T, src box, base string) box {
	t.Helper()
	snap, c := name(t, base+"snap"), name(t, base+"clone")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src.Name, snap)
	t.Cleanup(func() { kvbox(t, "rm", "--force", c) })
	mustKvbox(t, append([]string{"new", "--from", snap, c}, n.flags...)...)
	return getBox(t, c)
}

// boxGet fetches url from inside a box: its body, or "" when it cannot.
func boxGet(t *testing.T, n, url string) string {
	t.Helper()
	out := inBox(t, n, "timeout 5 wget -q -O - "+url+" 2>/dev/null || echo UNREACHABLE")
	if strings.Contains(out, "UNREACHABLE") {
		return ""
	}
	return strings.TrimSpace(out)
}

// boxPings reports whether a box gets an answer to a ping.
func boxPings(t *testing.T, n, ip string) bool {
	t.Helper()
	return strings.TrimSpace(inBox(t, n, "ping -c 2 -W 2 "+ip+" >/dev/null 2>&1 && echo yes || echo no")) == "yes"
}

// By default a box reaches the internet through the NAT and nothing else:
// not another box, not the host, not a private range or the metadata
// address beyond the bridge. Spoofing its address, its MAC or the
// gateway's ARP gets nothing onto the bridge, and a clone that keeps its
// source's identity gets no traffic through.
func TestNetworkIsolation(t *testing.T) {
	n := setupIsoNet(t)
	a := newBox(t, name(t, "isoa"), n.flags...)
	b := newBox(t, name(t, "isob"), n.flags...)
	inBox(t, a.Name, "mkdir -p /www && echo box-a > /www/index.html && setsid httpd -p 8080 -h /www </dev/null >/dev/null 2>&1")
	inet := "http://" + inetAddr + "/"

	t.Run("internet", func(t *testing.T) {
		for _, x := range []box{a, b} {
			if got := boxGet(t, x.Name, inet); got != "beyond" {
				t.Errorf("box %s cannot reach the internet server through the NAT: %q", x.Name, got)
			}
		}
	})
	t.Run("box to box", func(t *testing.T) {
		if body, err := httpGet("http://" + a.IP + ":8080/"); err != nil || strings.TrimSpace(body) != "box-a" {
			t.Fatalf("the host cannot reach box a's server: %q %v", body, err)
		}
		if boxPings(t, b.Name, a.IP) {
			t.Errorf("box b pings box a")
		}
		if got := boxGet(t, b.Name, "http://"+a.IP+":8080/"); got != "" {
			t.Errorf("box b reaches box a's server: %q", got)
		}
	})
	t.Run("host", func(t *testing.T) {
		if got := boxGet(t, b.Name, "http://"+n.gw+":"+hostPort+"/"); got != "" {
			t.Errorf("box b reaches the host's server on the bridge address: %q", got)
		}
		if boxPings(t, b.Name, n.gw) {
			t.Errorf("box b pings the host")
		}
		hostPing(t, b.IP) // the host still reaches the box
	})
	t.Run("beyond the bridge", func(t *testing.T) {
		for _, addr := range []string{metaAddr, privateAddr} {
			if got := boxGet(t, b.Name, "http://"+addr+"/"); got != "" {
				t.Errorf("box b reaches http://%s/: %q", addr, got)
			}
		}
	})

	t.Run("spoofing", func(t *testing.T) {
		hostPing(t, a.IP) // the host knows a's MAC
		// Everything b sends below is spoofed: a frame of it on the
		// bridge (the host's side of every port) means it got through.
		stop := capture(t, "-i", n.br, fmt.Sprintf("ether src 52:54:00:de:ad:01 or (ether src %s and not ((ip and src host %s) or (arp and arp[14:4] = %s)))", b.MAC, b.IP, hexIP(b.IP)))
		out := inBox(t, b.Name, strings.Join([]string{
			// take a's address
			"ip addr flush dev eth0", "ip addr add " + a.IP + "/24 dev eth0", "ip route add default via " + n.gw,
			"timeout 4 wget -q -O - " + inet + " && echo GOT-THROUGH-AS-A",
			"arping -c 2 -U -I eth0 -s " + a.IP + " " + a.IP,
			// claim the gateway
			"arping -c 2 -U -I eth0 -s " + n.gw + " " + n.gw,
			"arping -c 2 -A -I eth0 -s " + n.gw + " " + a.IP,
			// back to its own address, another MAC
			"ip addr flush dev eth0", "ip link set eth0 address 52:54:00:de:ad:01", "ip addr add " + b.IP + "/24 dev eth0",
			"ip route add default via " + n.gw,
			"timeout 4 wget -q -O - " + inet + " && echo GOT-THROUGH-WITH-MAC",
			"ip link set eth0 address " + b.MAC,
			// IPv6 (the agent turned it off on eth0; root in the box
			// turns it on): duplicate address detection, multicast
			// reports, link-local all-nodes
			"echo 0 >/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "sleep 2",
			"ping -6 -c 2 -W 1 ff02::1%eth0",
			"true",
		}, " >/dev/null 2>&1; ")+" 2>&1")
		if strings.Contains(out, "GOT-THROUGH") {
			t.Errorf("spoofed traffic reached the internet server: %s", out)
		}
		var leaked []string
		for _, l := range stop() {
			if strings.TrimSpace(l) != "" {
				leaked = append(leaked, l)
			}
		}
		if lines := leaked; len(lines) > 0 {
			t.Errorf("spoofed frames of box b reached the bridge: %q", lines)
		}
		neigh, _ := exec.Command("ip", "neigh", "show", a.IP, "dev", n.br).CombinedOutput()
		if !strings.Contains(strings.ToLower(string(neigh)), strings.ToLower(a.MAC)) {
			t.Errorf("the host's neighbour entry for box a is %q, want a's MAC %s", neigh, a.MAC)
		}
		if got := boxGet(t, a.Name, inet); got != "beyond" {
			t.Errorf("box a lost its network after b's spoofing: %q", got)
		}
		// b, itself again, works: what failed was the spoofing.
		if got := boxGet(t, b.Name, inet); got != "beyond" {
			t.Errorf("box b, back to its own identity, cannot reach the internet: %q", got)
		}
	})

	t.Run("clone keeping its source's identity", func(t *testing.T) {
		cb := n.clone(t, a, "iso")
		c := cb.Name
		// What an agent that refused the new identity would leave: the
		// source's MAC and address.
		out := inBox(t, c, strings.Join([]string{
			"ip link set eth0 down", "ip link set eth0 address " + a.MAC, "ip link set eth0 up",
			"ip addr flush dev eth0", "ip addr add " + a.IP + "/24 dev eth0", "ip route add default via " + n.gw,
			"timeout 5 wget -q -O - " + inet + " && echo GOT-THROUGH-AS-SOURCE",
			"ip link set eth0 down", "ip link set eth0 address " + cb.MAC, "ip link set eth0 up",
			"ip addr flush dev eth0", "ip addr add " + cb.IP + "/24 dev eth0", "ip route add default via " + n.gw,
			"true",
		}, " >/dev/null 2>&1; ")+" 2>&1")
		if strings.Contains(out, "GOT-THROUGH") {
			t.Errorf("a clone with its source's MAC and address reached the internet server")
		}
		if got := boxGet(t, c, inet); got != "beyond" {
			t.Errorf("the clone with its own identity cannot reach the internet: %q", got)
		}
	})
}

// hexIP is an IPv4 address as tcpdump's 32-bit literal.
func hexIP(s string) string {
	ip := net.ParseIP(s).To4()
	return fmt.Sprintf("0x%02x%02x%02x%02x", ip[0], ip[1], ip[2], ip[3])
}

// --network none: a box with no network interface at all, reached through
// its agent only; its clones have none either.
// TestPortFilterRebuilt: kvbox's port filter lives in the kernel only; once
// it is gone (a host reboot) the next kvbox command that sets the network
// up makes it again with every box in it, so their ports pass again.
func TestPortFilterRebuilt(t *testing.T) {
	n := name(t, "pfr")
	b := newBox(t, n)
	hostPing(t, b.IP)
	conn, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	conn.DelTable(&nftables.Table{Family: nftables.TableFamilyBridge, Name: "kvbox"})
	if err := conn.Flush(); err != nil {
		t.Fatalf("delete kvbox's table: %v", err)
	}
	mustKvbox(t, "network", "up")
	if !inPortFilter(t, b) {
		t.Errorf("the rebuilt port filter lacks box %s's port", n)
	}
	hostPing(t, b.IP)
}

// inPortFilter reports whether kvbox's port filter holds box b's port.
func inPortFilter(t *testing.T, b box) bool {
	t.Helper()
	conn, err := nftables.New()
	if err != nil {
		t.Fatal(err)
	}
	set, err := conn.GetSetByName(&nftables.Table{Family: nftables.TableFamilyBridge, Name: "kvbox"}, "ports")
	if err != nil {
		t.Logf("kvbox's port filter: %v", err)
		return false
	}
	els, err := conn.GetSetElements(set)
	if err != nil {
		t.Fatal(err)
	}
	tap := "kvb" + strings.ReplaceAll(b.MAC, ":", "")
	for _, e := range els {
		if strings.HasPrefix(string(e.Key), tap+"\x00") {
			return true
		}
	}
	return false
}

func TestNetworkNone(t *testing.T) {
	n := name(t, "nonet")
	b := newBox(t, n, "--network", "none")
	if b.IP != "" || b.MAC != "" {
		t.Errorf("a box without network has address %q, MAC %q", b.IP, b.MAC)
	}
	if got := inBox(t, n, "ls /sys/class/net"); strings.Fields(got)[0] != "lo" || len(strings.Fields(got)) != 1 {
		t.Errorf("interfaces in a --network none box: %q", got)
	}
	if x, err := virsh("dumpxml", n); err != nil || strings.Contains(x, "<interface") {
		t.Errorf("virsh dumpxml %s: %v, has an interface: %v", n, err, strings.Contains(x, "<interface"))
	}
	snap := name(t, "nonetsnap")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", n, snap)
	c := name(t, "nonetclone")
	if r := newClone(t, snap, c); r.code != 0 {
		t.Fatalf("clone of a --network none box: %s", r)
	}
	if got := inBox(t, c, "hostname; ls /sys/class/net"); got != c+"\nlo\n" {
		t.Errorf("in the clone: %q", got)
	}
	if cb := getBox(t, c); cb.IP != "" || cb.MAC != "" {
		t.Errorf("the clone of a box without network has address %q, MAC %q", cb.IP, cb.MAC)
	}
	for _, args := range [][]string{
		{"new", "--from", snap, "--network", "none", name(t, "nonetx")},
		{"new", "--network", "bogus", name(t, "nonety")},
		{"new", "--network", "group:", name(t, "nonety")},
		{"new", "--network", "group:../x", name(t, "nonety")},
		{"new", "--network", "group:a b", name(t, "nonety")},
		{"new", "--from", snap, "--network", "group:g", name(t, "nonety")},
	} {
		if r := kvbox(t, args...); r.code != 2 || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("kvbox %v: want exit 2 and one line: %s", args, r)
		}
	}
}

// Boxes of one group (--network group:NAME) reach each other and nothing
// else an isolated box cannot reach: not a box of another group or an
// isolated one, not the host, not beyond the bridge; the internet through
// the NAT. The port filter holds inside a group (a box taking a
// groupmate's address gets not one frame out), a clone of a group box's
// snapshot is in the group, and a group's network goes with its last box.
func TestNetworkGroups(t *testing.T) {
	n := setupIsoNet(t)
	g1, g2 := name(t, "g1"), name(t, "g2")
	a := newBox(t, name(t, "ga"), append(n.flags, "--network", "group:"+g1)...)
	b := newBox(t, name(t, "gb"), append(n.flags, "--network", "group:"+g1)...)
	c := newBox(t, name(t, "gc"), append(n.flags, "--network", "group:"+g2)...)
	d := newBox(t, name(t, "gd"), n.flags...)
	br1, br2 := groupBridge(g1), groupBridge(g2)
	if a.Group != g1 || a.Bridge != br1 || b.Bridge != br1 || c.Bridge != br2 || d.Bridge != n.br || a.Gateway == c.Gateway || a.Gateway == n.gw {
		t.Fatalf("groups: a %s on %s (gw %s), b on %s, c %s on %s (gw %s), d on %s", a.Group, a.Bridge, a.Gateway, b.Bridge, c.Group, c.Bridge, c.Gateway, d.Bridge)
	}
	for _, x := range []box{a, b, c, d} {
		inBox(t, x.Name, "mkdir -p /www && echo "+x.Name+" > /www/index.html && setsid httpd -p 8080 -h /www </dev/null >/dev/null 2>&1")
	}
	// reaches: TCP (to's server) or ICMP from one box to another.
	reaches := func(from, to box) bool {
		t.Helper()
		return strings.TrimSpace(inBox(t, from.Name, fmt.Sprintf("(timeout 3 wget -q -O - http://%s:8080/ | grep -qx %s && echo yes) || (ping -c 1 -W 2 %s >/dev/null 2>&1 && echo yes) || echo no", to.IP, to.Name, to.IP))) == "yes"
	}
	inet := "http://" + inetAddr + "/"

	t.Run("in the group", func(t *testing.T) {
		if got := boxGet(t, a.Name, "http://"+b.IP+":8080/"); got != b.Name {
			t.Errorf("box a cannot reach its groupmate b's server: %q", got)
		}
		if !boxPings(t, b.Name, a.IP) {
			t.Errorf("box b cannot ping its groupmate a")
		}
	})
	t.Run("across groups", func(t *testing.T) {
		for _, p := range [][2]box{{a, c}, {c, a}, {a, d}, {d, a}, {c, d}} {
			if reaches(p[0], p[1]) {
				t.Errorf("box %s reaches box %s of another group", p[0].Name, p[1].Name)
			}
		}
	})
	t.Run("host and beyond", func(t *testing.T) {
		for _, gw := range []string{a.Gateway, n.gw} {
			if boxPings(t, a.Name, gw) {
				t.Errorf("box a pings the host at %s", gw)
			}
		}
		for _, u := range []string{"http://" + n.gw + ":" + hostPort + "/", "http://" + metaAddr + "/", "http://" + privateAddr + "/"} {
			if got := boxGet(t, a.Name, u); got != "" {
				t.Errorf("box a reaches %s: %q", u, got)
			}
		}
		hostPing(t, a.IP)
	})
	t.Run("internet", func(t *testing.T) {
		for _, x := range []box{a, c} {
			if got := boxGet(t, x.Name, inet); got != "beyond" {
				t.Errorf("group box %s cannot reach the internet server through the NAT: %q", x.Name, got)
			}
		}
	})
	t.Run("spoofing a groupmate", func(t *testing.T) {
		stop := capture(t, "-i", br1, fmt.Sprintf("ether src %s and not ((ip and src host %s) or (arp and arp[14:4] = %s))", a.MAC, a.IP, hexIP(a.IP)))
		out := inBox(t, a.Name, strings.Join([]string{
			"ip addr flush dev eth0", "ip addr add " + b.IP + "/24 dev eth0", "ip route add default via " + a.Gateway,
			"timeout 4 wget -q -O - " + inet + " && echo GOT-THROUGH-AS-B",
			"arping -c 2 -U -I eth0 -s " + b.IP + " " + b.IP,
			"ip addr flush dev eth0", "ip addr add " + a.IP + "/24 dev eth0", "ip route add default via " + a.Gateway,
			"true",
		}, " >/dev/null 2>&1; ")+" 2>&1")
		if strings.Contains(out, "GOT-THROUGH") {
			t.Errorf("box a, as b, reached the internet server")
		}
		if leaked := strings.TrimSpace(strings.Join(stop(), "")); leaked != "" {
			t.Errorf("box a's frames as b reached the group's bridge: %s", leaked)
		}
		if got := boxGet(t, a.Name, "http://"+b.IP+":8080/"); got != b.Name {
			t.Errorf("box a, itself again, cannot reach b: %q", got)
		}
	})
	t.Run("a clone is in its snapshot's group", func(t *testing.T) {
		eb := n.clone(t, b, "g")
		e := eb.Name
		if eb.Group != g1 || eb.Bridge != br1 {
			t.Fatalf("clone of a box of group %s: group %q on %s", g1, eb.Group, eb.Bridge)
		}
		if got := boxGet(t, e, "http://"+a.IP+":8080/"); got != a.Name {
			t.Errorf("the clone cannot reach box a of its group: %q", got)
		}
		if reaches(eb, d) || reaches(eb, c) {
			t.Errorf("the clone reaches a box outside its group")
		}
		mustKvbox(t, "rm", "--force", e)
	})
	t.Run("made again after a reboot", func(t *testing.T) {
		// What a host reboot leaves of group g2: its box c defined, its
		// bridge and firewall gone.
		mustKvbox(t, "stop", "--force", c.Name)
		if out, err := exec.Command("ip", "link", "del", br2).CombinedOutput(); err != nil {
			t.Fatalf("ip link del %s: %v %s", br2, err, out)
		}
		mustKvbox(t, append([]string{"start", c.Name}, n.flags...)...)
		if got := boxGet(t, c.Name, inet); got != "beyond" {
			t.Errorf("group box %s started after its group's bridge was gone cannot reach the internet: %q", c.Name, got)
		}
		if reaches(c, d) {
			t.Errorf("box %s reaches box %s of another group after the restart", c.Name, d.Name)
		}
	})
	t.Run("network rm keeps the port filter for groups", func(t *testing.T) {
		// The test's main network loses its last box and goes; group g2's
		// box c still needs kvbox's port filter, which every bridge shares.
		mustKvbox(t, "rm", "--force", d.Name)
		mustKvbox(t, append(n.flags, "network", "rm")...)
		if !inPortFilter(t, c) {
			t.Errorf("network rm took box %s of group %s out of kvbox's port filter", c.Name, g2)
		}
		if got := boxGet(t, c.Name, "http://"+metaAddr+"/"); got != "" {
			t.Errorf("box %s reaches the metadata server after network rm: %q", c.Name, got)
		}
	})
	t.Run("a group's network goes with its last box", func(t *testing.T) {
		mustKvbox(t, "rm", "--force", a.Name)
		if _, err := net.InterfaceByName(br1); err != nil {
			t.Fatalf("group %s lost its bridge while box b is in it: %v", g1, err)
		}
		mustKvbox(t, "rm", "--force", b.Name)
		if _, err := net.InterfaceByName(br1); err == nil {
			t.Errorf("group %s's bridge %s is left after its last box", g1, br1)
		}
		if out, _ := exec.Command("iptables-save").CombinedOutput(); strings.Contains(string(out), br1) {
			t.Errorf("firewall rules of group %s are left:\n%s", g1, out)
		}
		if _, err := net.InterfaceByName(br2); err != nil {
			t.Errorf("group %s lost its bridge: %v", g2, err)
		}
	})
}

// Two groups never share a bridge: group-22235 and group-30796, whose
// names' hashes agree in their first 32 bits (network.TestGroupBridgeNames),
// get one each, marked with their group's name, and their boxes do not
// reach each other.
func TestGroupBridgesApart(t *testing.T) {
	g1, g2 := "group-22235", "group-30796"
	a := newBox(t, name(t, "gapa"), "--network", "group:"+g1)
	b := newBox(t, name(t, "gapb"), "--network", "group:"+g2)
	if a.Bridge == b.Bridge || a.Bridge != groupBridge(g1) || b.Bridge != groupBridge(g2) {
		t.Fatalf("group %s is on %s, group %s on %s", g1, a.Bridge, g2, b.Bridge)
	}
	for _, x := range []box{a, b} {
		out, err := exec.Command("ip", "-d", "link", "show", x.Bridge).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "alias kvbox group "+groupKey(x.Group)) {
			t.Errorf("bridge %s is not marked as group %s's: %v\n%s", x.Bridge, x.Group, err, out)
		}
	}
	if boxPings(t, a.Name, b.IP) || boxPings(t, b.Name, a.IP) {
		t.Errorf("boxes of groups %s and %s reach each other", g1, g2)
	}
}
