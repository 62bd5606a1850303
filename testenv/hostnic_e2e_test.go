//go:build e2e

package testenv

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// Whatever a box sends, on any path the host's kernel offers, reaches no
// host socket and changes no host state. A box runs testenv/hostilenic:
// raw frames to the reserved link-local group MACs (which a bridge hands up
// its port's own stack instead of forwarding), to broadcast and multicast,
// to the bridge's and its tap's MAC, as itself and spoofed, carrying IPv4
// and IPv6 to every address of this namespace, ARP and ND claims and a
// router advertisement; then its own TCP/UDP stack with the host's
// addresses pinned to each link-local group MAC in turn. The host listens
// on every address (TCP and UDP, IPv4 and IPv6) and receives nothing; its
// routes, neighbours, addresses, bridge forwarding entries and sysctls on
// the box's bridge and tap (and the namespace-wide ones) are as before.
// rp_filter is 0 here, the kernel's default, under which a spoofed source
// passes the host's own check. (TCP to a group address reaches no socket
// even unfiltered: the kernel's TCP takes only segments sent to the
// receiving interface's own MAC. UDP and ICMP do.) Then the same with the
// box's tap up outside its bridge, where no bridge rule applies and the
// tap is an interface of the host's, its MAC the host's: what kvbox's inet
// and arp tables are for.
func TestHostileFramesReachNoHost(t *testing.T) {
	for _, k := range []string{"net/ipv4/conf/all/rp_filter", "net/ipv4/conf/default/rp_filter"} {
		setSysctl(t, k, "0")
	}
	n := name(t, "hostile")
	b := newBox(t, n)
	if b.Tap == "" || b.Bridge == "" {
		t.Fatalf("box %s has no tap or bridge: %+v", n, b)
	}
	hostPing(t, b.IP)

	bin := filepath.Join(t.TempDir(), "hostilenic")
	build := exec.Command("go", "build", "-o", bin, "./hostilenic")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./hostilenic: %v\n%s", err, out)
	}
	mustKvbox(t, "cp", bin, n+":/root/hostilenic")

	l := listenEverywhere(t)
	var v4, v6 []string
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, ifc := range ifs {
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			ip := a.(*net.IPNet).IP
			if ip.To4() != nil {
				v4 = append(v4, ip.String())
			} else {
				v6 = append(v6, ip.String())
			}
		}
	}
	if !slices.Contains(v4, b.Gateway) {
		t.Fatalf("the gateway %s is not among this namespace's addresses %v", b.Gateway, v4)
	}
	brIf, err := net.InterfaceByName(b.Bridge)
	if err != nil {
		t.Fatal(err)
	}
	tapIf, err := net.InterfaceByName(b.Tap)
	if err != nil {
		t.Fatal(err)
	}
	brMAC, tapMAC := brIf.HardwareAddr.String(), tapIf.HardwareAddr.String()
	var linkLocal []string
	for i := 0; i < 16; i++ {
		linkLocal = append(linkLocal, fmt.Sprintf("01:80:c2:00:00:%02x", i))
	}
	prefix := 24
	if _, p, err := net.ParseCIDR(envOr("KVBOX_SUBNET", "172.30.0.0/24")); err == nil {
		prefix, _ = p.Mask.Size()
	}
	const spoofMAC = "52:54:00:de:ad:02"

	// attack runs hostilenic in the box with these raw destinations,
	// pinned MACs and host addresses, and checks the host took nothing of
	// it.
	attack := func(t *testing.T, dests, pinned, v4, v6 []string) {
		t.Helper()
		js, _ := json.Marshal(map[string]any{
			"mac": b.MAC, "ip": b.IP, "gateway": b.Gateway, "prefix": prefix,
			"spoof_mac": spoofMAC, "spoof_ip": spoofedAddr(b),
			"dests": dests, "pinned": pinned,
			"host_v4": v4, "host_v6": v6,
			"port": l.port, "tag": "kvbox-hostile-" + runID, "dial_ms": 2000,
		})
		l.take()
		before := hostState(t, b.Bridge, b.Tap)
		// What the box sends, as the host's side of its port sees it:
		// proof that the frames were sent.
		stop := capture(t, "-i", b.Tap, "ether src "+b.MAC+" or ether src "+spoofMAC)
		out := mustKvbox(t, "exec", n, "--", "/root/hostilenic", "-config", string(js))
		frames := stop()
		after := hostState(t, b.Bridge, b.Tap)

		var rep struct {
			Iface     string
			Sent      int
			Dialed    int
			Connected []string
			Answers   []string
			Errors    []string
		}
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			t.Fatalf("hostilenic printed %q: %v", out, err)
		}
		t.Logf("the box sent %d raw frames on %s and dialed %d times; its tap saw %d frames of it", rep.Sent, rep.Iface, rep.Dialed, len(frames))
		if len(rep.Errors) > 0 || rep.Sent == 0 || rep.Dialed == 0 {
			t.Fatalf("the box could not send what it should: %+v", rep)
		}
		for _, m := range append(append([]string(nil), dests...), pinned...) {
			if !slices.ContainsFunc(frames, func(l string) bool { return strings.Contains(l, "> "+m) }) {
				t.Errorf("no frame of the box to %s reached its tap: the test sent nothing on that path", m)
			}
		}
		for _, r := range l.take() {
			t.Errorf("a host listener received: %s", r)
		}
		for _, c := range rep.Connected {
			t.Errorf("the box connected to the host: %s", c)
		}
		for _, a := range rep.Answers {
			t.Errorf("the host answered the box: %s", a)
		}
		for _, d := range diffState(before, after) {
			t.Errorf("host state changed: %s", d)
		}
	}

	t.Run("through its bridge", func(t *testing.T) {
		attack(t, append(append([]string(nil), linkLocal...), "ff:ff:ff:ff:ff:ff", "01:00:5e:00:00:01", "33:33:00:00:00:01", brMAC, tapMAC), linkLocal, v4, v6)
		// The box's ordinary network still works: the host reaches it.
		hostPing(t, b.IP)
	})
	t.Run("its tap up outside its bridge", func(t *testing.T) {
		run := func(args ...string) {
			t.Helper()
			if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
				t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
			}
		}
		// The tap detached from the bridge and up (kvbox takes a closed
		// port's tap down as well): no bridge rule in the way, only the
		// tap tables.
		run("ip", "link", "set", b.Tap, "nomaster")
		t.Cleanup(func() {
			run("ip", "link", "set", b.Tap, "down")
			run("ip", "link", "set", b.Tap, "master", b.Bridge)
			run("bridge", "link", "set", "dev", b.Tap, "isolated", "on")
			run("ip", "link", "set", b.Tap, "up")
			hostPing(t, b.IP)
		})
		// The host's addresses that stay while the test runs (this
		// namespace's others come and go with other tests): a packet the
		// host cannot route draws an ICMP error from its routing code
		// before any input hook, which kvbox's tables do not stop (see
		// SECURITY.md).
		var tapV6 []string
		addrs, _ := tapIf.Addrs()
		for _, a := range addrs {
			tapV6 = append(tapV6, a.(*net.IPNet).IP.String())
		}
		attack(t, []string{tapMAC, "01:80:c2:00:00:03", "ff:ff:ff:ff:ff:ff"}, []string{tapMAC}, []string{b.Gateway, "127.0.0.1"}, append(tapV6, "::1"))
	})
}

// spoofedAddr is an address of the box's subnet that is not the box's.
func spoofedAddr(b box) string {
	ip := net.ParseIP(b.IP).To4()
	last := byte(250)
	if ip[3] == last {
		last = 251
	}
	return fmt.Sprintf("%d.%d.%d.%d", ip[0], ip[1], ip[2], last)
}

// setSysctl sets a sysctl of this namespace for the test and puts the old
// value back after it.
func setSysctl(t *testing.T, key, v string) {
	t.Helper()
	p := "/proc/sys/" + key
	old, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(v+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(p, old, 0o644) })
}

// listeners: TCP and UDP, IPv4 and IPv6, on every address of this
// namespace (the wildcard address), one port.
type listeners struct {
	port int
	mu   sync.Mutex
	got  []string
}

func (l *listeners) add(s string) {
	l.mu.Lock()
	l.got = append(l.got, s)
	l.mu.Unlock()
}

// take returns what the listeners received since the last take.
func (l *listeners) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	got := l.got
	l.got = nil
	return got
}

func listenEverywhere(t *testing.T) *listeners {
	t.Helper()
	for try := 0; try < 20; try++ {
		t4, err := net.Listen("tcp4", "0.0.0.0:0")
		if err != nil {
			t.Fatal(err)
		}
		l := &listeners{port: t4.Addr().(*net.TCPAddr).Port}
		p := fmt.Sprint(l.port)
		t6, err := net.Listen("tcp6", "[::]:"+p)
		if err != nil {
			t4.Close()
			continue // the port is taken for IPv6
		}
		u4, err := net.ListenPacket("udp4", "0.0.0.0:"+p)
		if err != nil {
			t4.Close()
			t6.Close()
			continue
		}
		u6, err := net.ListenPacket("udp6", "[::]:"+p)
		if err != nil {
			t4.Close()
			t6.Close()
			u4.Close()
			continue
		}
		for _, tl := range []net.Listener{t4, t6} {
			t.Cleanup(func() { tl.Close() })
			go func() {
				for {
					c, err := tl.Accept()
					if err != nil {
						return
					}
					c.SetReadDeadline(time.Now().Add(3 * time.Second))
					buf := make([]byte, 512)
					k, _ := c.Read(buf)
					l.add(fmt.Sprintf("TCP connection from %s to %s: %q", c.RemoteAddr(), c.LocalAddr(), buf[:k]))
					c.Close()
				}
			}()
		}
		for _, ul := range []net.PacketConn{u4, u6} {
			t.Cleanup(func() { ul.Close() })
			go func() {
				buf := make([]byte, 2048)
				for {
					k, from, err := ul.ReadFrom(buf)
					if err != nil {
						return
					}
					l.add(fmt.Sprintf("UDP datagram from %s to %s: %q", from, ul.LocalAddr(), buf[:k]))
				}
			}()
		}
		return l
	}
	t.Fatal("no port free for TCP and UDP on IPv4 and IPv6")
	return nil
}

// hostState is what a box could change on the host: per kind, a set of
// lines. Routes, neighbours, addresses and bridge forwarding entries of
// the box's bridge and tap (and any default route), and the sysctls of
// those devices and the namespace-wide ones.
func hostState(t *testing.T, br, tap string) map[string]map[string]bool {
	t.Helper()
	st := map[string]map[string]bool{}
	add := func(kind, line string) {
		if st[kind] == nil {
			st[kind] = map[string]bool{}
		}
		st[kind][line] = true
	}
	ours := regexp.MustCompile(`\bdev (` + regexp.QuoteMeta(br) + `|` + regexp.QuoteMeta(tap) + `)\b`)
	cmd := func(args ...string) []string {
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return strings.Split(strings.TrimSpace(string(out)), "\n")
	}
	for _, fam := range []string{"-4", "-6"} {
		for _, l := range append(cmd("ip", fam, "route", "show", "table", "all"), cmd("ip", fam, "route", "show", "cache")...) {
			if ours.MatchString(l) || strings.HasPrefix(l, "default") || strings.Contains(l, "2001:db8:6b76") {
				// A bridge without a port up says so on its routes.
				add("route", strings.Replace(l, " linkdown", "", 1))
			}
		}
		for _, l := range cmd("ip", fam, "neigh", "show") {
			if ours.MatchString(l) {
				// The state (REACHABLE, STALE, ...) changes by itself.
				add("neighbour", strings.Join(strings.Fields(l)[:min(len(strings.Fields(l)), 5)], " "))
			}
		}
	}
	for _, dev := range []string{br, tap} {
		for _, l := range cmd("ip", "-o", "addr", "show", "dev", dev) {
			if f := strings.Fields(l); len(f) >= 4 {
				add("address", dev+" "+f[2]+" "+f[3])
			}
		}
	}
	for _, l := range cmd("bridge", "fdb", "show", "br", br) {
		add("bridge forwarding entry", l)
	}
	for _, dir := range []string{"ipv4/conf", "ipv6/conf", "ipv4/neigh", "ipv6/neigh"} {
		for _, dev := range []string{"all", "default", br, tap} {
			ents, _ := os.ReadDir("/proc/sys/net/" + dir + "/" + dev)
			for _, e := range ents {
				p := "/proc/sys/net/" + dir + "/" + dev + "/" + e.Name()
				if v, err := os.ReadFile(p); err == nil {
					add("sysctl", p+" = "+strings.TrimSpace(string(v)))
				}
			}
		}
	}
	for _, p := range []string{"/proc/sys/net/ipv4/ip_forward"} {
		if v, err := os.ReadFile(p); err == nil {
			add("sysctl", p+" = "+strings.TrimSpace(string(v)))
		}
	}
	return st
}

// diffState lists what after has that before had not. What went is no
// box's doing (a neighbour entry or a learned MAC that aged out), except
// for sysctls, which are compared both ways.
func diffState(before, after map[string]map[string]bool) []string {
	var d []string
	for kind, lines := range after {
		for l := range lines {
			if !before[kind][l] {
				d = append(d, "new "+kind+": "+l)
			}
		}
	}
	for l := range before["sysctl"] {
		if !after["sysctl"][l] {
			d = append(d, "sysctl was: "+l)
		}
	}
	sort.Strings(d)
	return d
}
