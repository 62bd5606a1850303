package agent

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/testenv/gate"
)

func TestIdentityValidate(t *testing.T) {
	tests := []struct {
		name string
		id   Identity
		ok   bool
	}{
		{"empty", Identity{}, true},
		{"full", Identity{Hostname: "box-1.example", MAC: "52:54:00:12:34:56", Address: "172.30.0.5/24", Gateway: "172.30.0.1", DNS: []string{"1.1.1.1"}, MachineID: "0123456789abcdef0123456789ABCDEF"}, true},
		{"hostname underscore", Identity{Hostname: "my_box"}, false},
		{"hostname dash", Identity{Hostname: "-box"}, false},
		{"hostname long", Identity{Hostname: strings.Repeat("a", 65)}, false},
		{"mac short", Identity{MAC: "52:54:00:12:34"}, false},
		{"mac multicast", Identity{MAC: "01:54:00:12:34:56"}, false},
		{"address no prefix", Identity{Address: "172.30.0.5"}, false},
		{"gateway bad", Identity{Address: "172.30.0.5/24", Gateway: "gw"}, false},
		{"gateway alone", Identity{Gateway: "172.30.0.1"}, false},
		{"dns bad", Identity{DNS: []string{"dns.example"}}, false},
		{"machine id short", Identity{MachineID: "abc"}, false},
		{"machine id not hex", Identity{MachineID: strings.Repeat("g", 32)}, false},
		{"hosts newline", Identity{Hosts: []string{"1.2.3.4 a\n5.6.7.8 b"}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.id.Validate(); (err == nil) != tt.ok {
				t.Errorf("Validate() = %v, want ok=%v", err, tt.ok)
			}
		})
	}
}

func TestApplyFiles(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/machine-id"), []byte("old\n"), 0o444)
	os.Symlink("/run/somewhere/stub-resolv.conf", filepath.Join(root, "etc/resolv.conf"))
	id := Identity{Hostname: "b2.lan", DNS: []string{"172.30.0.1", "fd00::1"}, MachineID: "0123456789ABCDEF0123456789abcdef", Hosts: []string{"172.30.0.1 gw"}}
	if err := applyFiles(root, id); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"etc/hostname":    "b2.lan\n",
		"etc/hosts":       "127.0.0.1\tlocalhost\n127.0.1.1\tb2.lan b2\n::1\tlocalhost ip6-localhost ip6-loopback\n172.30.0.1 gw\n",
		"etc/machine-id":  "0123456789abcdef0123456789abcdef\n",
		"etc/resolv.conf": "nameserver 172.30.0.1\nnameserver fd00::1\n",
	}
	for name, w := range want {
		b, err := os.ReadFile(filepath.Join(root, name))
		if err != nil || string(b) != w {
			t.Errorf("%s = %q, %v; want %q", name, b, err, w)
		}
	}
	// No machine-id file: none is created (systemd's first boot logic).
	root2 := t.TempDir()
	os.MkdirAll(filepath.Join(root2, "etc"), 0o755)
	if err := applyFiles(root2, Identity{MachineID: id.MachineID}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root2, "etc/machine-id")); err == nil {
		t.Error("machine-id created")
	}
}

// nsChildEnv names the test a child process runs inside its own namespaces
// (inNamespaces).
const nsChildEnv = "KVBOX_TEST_NAMESPACE_CHILD"

// inNamespaces runs the calling test again in a child process made in fresh
// network, UTS and mount namespaces, so that the real LinuxSystem changes
// "the" network and hostname of that child only. Every thread of the child
// is in them: no goroutine of the code under test can reach the host's,
// whichever thread it runs on. It returns true in the child, where the
// test's body runs; in the parent it waits for the child, fails the test
// with its output unless the child ran the test and passed, and returns
// false.
func inNamespaces(t *testing.T) bool {
	t.Helper()
	if os.Getenv(nsChildEnv) == t.Name() {
		return true
	}
	gate.Root(t) // for the namespaces
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), nsChildEnv+"="+t.Name())
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET | syscall.CLONE_NEWUTS | syscall.CLONE_NEWNS}
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: "+t.Name()) {
		t.Fatalf("%s in its own namespaces: %v\n%s", t.Name(), err, out)
	}
	return false
}

// hostname is the name of the UTS namespace of the calling thread.
func hostname(t *testing.T) string {
	t.Helper()
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	return unix.ByteSliceToString(u.Nodename[:])
}

// The identity changes the network and hostname of the namespaces it runs
// in, and nothing of the host's: the child's hostname is the new one, the
// parent's (the host's) the one it had.
func TestLinuxSystemApplyIdentity(t *testing.T) {
	const newName = "kvbox-test-clone7"
	if host := hostname(t); !inNamespaces(t) {
		if now := hostname(t); now != host {
			t.Fatalf("this machine's hostname changed from %q to %q", host, now)
		}
		if host == newName {
			t.Fatalf("this machine is called %q already: the test cannot tell its namespace from the host's", host)
		}
		return
	}
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	s := &LinuxSystem{Root: root}
	id := Identity{Hostname: newName, MAC: "52:54:00:aa:bb:07", Address: "172.30.0.7/24", Gateway: "172.30.0.1"}
	// The "guest NIC", carrying the source box's identity (this host's
	// kernel has veth but no dummy).
	la := netlink.NewLinkAttrs()
	la.Name = "eth0"
	la.HardwareAddr, _ = net.ParseMAC("52:54:00:aa:bb:01")
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "peer0"}); err != nil {
		t.Fatal(err)
	}
	l, err := primaryLink()
	if err != nil {
		t.Fatal(err)
	}
	name := l.Attrs().Name
	old, _ := netlink.ParseAddr("172.30.0.1/24")
	netlink.AddrAdd(l, old)
	if !s.Capabilities().Identify {
		t.Fatal("Capabilities: cannot identify")
	}
	// First the source's own identity, then the clone's from the link and
	// netlink socket the first one kept.
	if err := s.ApplyIdentity(Identity{Hostname: "source", MAC: "52:54:00:aa:bb:02", Address: "172.30.0.2/24", Gateway: "172.30.0.1"}); err != nil {
		t.Fatal(err)
	}
	if s.net.link == nil || s.net.mac.String() != "52:54:00:aa:bb:02" {
		t.Fatalf("after the first identity: link %v, mac %s", s.net.link, s.net.mac)
	}
	if err := s.ApplyIdentity(id); err != nil {
		t.Fatal(err)
	}
	if l, err = netlink.LinkByName(name); err != nil {
		t.Fatal(err)
	}
	var addr, gw string
	addrs, _ := netlink.AddrList(l, netlink.FAMILY_V4)
	for _, a := range addrs {
		addr += a.IPNet.String() + " "
	}
	routes, _ := netlink.RouteList(l, netlink.FAMILY_V4)
	for _, r := range routes {
		if r.Dst == nil || r.Dst.IP.IsUnspecified() {
			gw = r.Gw.String()
		}
	}
	if mac := l.Attrs().HardwareAddr.String(); mac != id.MAC || addr != "172.30.0.7/24 " || gw != id.Gateway {
		t.Errorf("after ApplyIdentity: mac %s, addresses %q, gateway %s", mac, addr, gw)
	}
	if h := hostname(t); h != newName {
		t.Errorf("hostname %q, want %q", h, newName)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "etc/hostname")); string(b) != newName+"\n" {
		t.Errorf("/etc/hostname = %q", b)
	}
}

func TestFindSerialPorts(t *testing.T) {
	sys := t.TempDir()
	for dev, name := range map[string]string{
		"vport1p1": "org.qemu.guest_agent.0",
		"vport2p2": "org.kvbox.agent.1",
		"vport2p1": "org.kvbox.agent.0",
		"vport3p1": "",
	} {
		os.MkdirAll(filepath.Join(sys, dev), 0o755)
		if name != "" {
			os.WriteFile(filepath.Join(sys, dev, "name"), []byte(name+"\n"), 0o644)
		}
	}
	got, err := FindSerialPorts(sys, "/dev")
	if err != nil || strings.Join(got, " ") != "/dev/vport2p1 /dev/vport2p2" {
		t.Fatalf("got %v, %v", got, err)
	}
	if got, err := FindSerialPorts(filepath.Join(sys, "none"), "/dev"); err != nil || len(got) != 0 {
		t.Fatalf("missing sysfs dir: %v, %v", got, err)
	}
}

// chanReader is a stream fed by the test: a []byte or an error per Read,
// like a virtio-serial port whose host comes and goes.
type chanReader chan any

func (c chanReader) Read(b []byte) (int, error) {
	v, ok := <-c
	if !ok {
		return 0, net.ErrClosed
	}
	if err, isErr := v.(error); isErr {
		return 0, err
	}
	return copy(b, v.([]byte)), nil
}

// TestHostGoneKills: on a port, a host disconnect (EOF from the port) kills
// the exec and the next host is served on the same stream.
func TestHostGoneKills(t *testing.T) {
	in := make(chanReader, 10)
	out, w := net.Pipe()
	go func() { // the host side reads everything
		buf := make([]byte, 64<<10)
		for {
			if _, err := out.Read(buf); err != nil {
				return
			}
		}
	}()
	done := make(chan error)
	go func() { done <- testServer(t).serve(in, w, "port", false, true) }()
	pidfile := t.TempDir() + "/pid"
	var b []byte
	b = appendFrame(b, frameHello, 1, make([]byte, 16))
	b = appendFrame(b, frameRequest, 2, []byte(`{"method":"exec","params":{"argv":["sh","-c","echo $$ > `+pidfile+`; sleep 100"]}}`))
	b = append(b, appendFrame(nil, frameStdin, 2, make([]byte, 1000))[:100]...) // cut short by the disconnect
	in <- b
	pid := waitPid(t, pidfile)
	in <- errHostGone
	waitGone(t, pid)
	in <- appendFrame(nil, frameHello, 3, make([]byte, 16))
	close(in)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("serve did not return")
	}
}

// A request's environment replaces the default one, so DefaultEnv (what
// kvbox exec -t sends) must hold PATH and HOME besides TERM.
func TestDefaultEnvOnTerminal(t *testing.T) {
	env := DefaultEnv(true, "vt100")
	want := map[string]bool{"PATH=" + defaultPath: true, "HOME=/root": true, "TERM=vt100": true}
	if len(env) != len(want) {
		t.Fatalf("DefaultEnv = %q", env)
	}
	for _, e := range env {
		if !want[e] {
			t.Errorf("DefaultEnv has %q", e)
		}
	}
	if got := execEnv(ExecRequest{Argv: []string{"sh"}, TTY: true, Env: DefaultEnv(true, "")}, nil); len(got) != 3 {
		t.Errorf("execEnv of a terminal request = %q", got)
	}
}

// ReprobeBalloon writes each device the balloon driver drives to its
// unbind file, then to its bind file.
func TestReprobeBalloon(t *testing.T) {
	s := &LinuxSystem{Root: t.TempDir()}
	if err := s.ReprobeBalloon(); err == nil {
		t.Fatal("no balloon driver: no error")
	}
	dir := s.path(balloonDriver)
	for _, f := range []string{"virtio3", "bind", "unbind", "uevent"} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.ReprobeBalloon(); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"unbind", "bind"} {
		if b, _ := os.ReadFile(filepath.Join(dir, f)); string(b) != "virtio3" {
			t.Errorf("%s got %q, want virtio3", f, b)
		}
	}
	os.Remove(filepath.Join(dir, "virtio3"))
	if err := s.ReprobeBalloon(); err == nil {
		t.Error("a driver with no device: no error")
	}
}
