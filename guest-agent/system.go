package agent

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// LinuxSystem changes the machine it runs on. Only the agent in a guest
// uses it; tests use a fake System, or this one inside throwaway network
// and UTS namespaces.
type LinuxSystem struct {
	// Root is where /etc lives ("/" in a guest; a temp dir in tests).
	Root string
	// mu serializes identity changes: the identity saved at boot is
	// re-applied in the background while the host may already be sending
	// its own, and two flush-then-add sequences must not interleave.
	mu sync.Mutex
	// hasLink is set once an ethernet link was found. Links are not
	// unplugged from a box, and finding one is a netlink dump: in a clone
	// under TCG it is cold code, which answering a ping ran alongside the
	// identity (and on the agent's reader, delaying the frames behind it)
	// (docs/design.md#the-agent-under-tcg).
	hasLink atomic.Bool
	// net is what netState.apply keeps between identities (under mu). A
	// clone's agent is its source's process, so it starts with its
	// source's: no netlink socket to open and no link dump to run and
	// parse, a large part of a clone's re-identification under TCG
	// (docs/design.md#the-agent-under-tcg).
	net netState
}

// netState is the primary link as applyNetwork found and left it.
type netState struct {
	h    *netlink.Handle // a route netlink socket, kept open
	link netlink.Link    // the primary link
	mac  net.HardwareAddr
}

// NewLinuxSystem returns the System of the running guest.
func NewLinuxSystem() *LinuxSystem { return &LinuxSystem{Root: "/"} }

func (s *LinuxSystem) path(p string) string { return filepath.Join(s.Root, p) }

// Capabilities reports what this process may change.
func (s *LinuxSystem) Capabilities() Capabilities {
	root := os.Geteuid() == 0
	var c Capabilities
	c.Clock = root
	if _, err := os.Stat("/dev/urandom"); err == nil {
		c.Entropy = root
	}
	if root && !s.hasLink.Load() {
		if _, err := primaryLink(); err == nil {
			s.hasLink.Store(true)
		}
	}
	c.Identify = root && s.hasLink.Load()
	return c
}

// Validate checks an identity before anything is changed, so a bad field
// never leaves a half-applied identity behind.
func (id Identity) Validate() error {
	if id.Hostname != "" && !validHostname(id.Hostname) {
		return fmt.Errorf("hostname %q: want letters, digits, '-' and '.', at most 64 characters", id.Hostname)
	}
	if id.MAC != "" {
		hw, err := net.ParseMAC(id.MAC)
		if err != nil || len(hw) != 6 {
			return fmt.Errorf("mac %q: want six hex bytes like 52:54:00:12:34:56", id.MAC)
		}
		if hw[0]&1 != 0 {
			return fmt.Errorf("mac %q: multicast address", id.MAC)
		}
	}
	if id.Address != "" {
		ip, _, err := net.ParseCIDR(id.Address)
		if err != nil || ip.To4() == nil && ip.To16() == nil {
			return fmt.Errorf("address %q: want CIDR like 172.30.0.5/24", id.Address)
		}
	}
	if id.Gateway != "" && net.ParseIP(id.Gateway) == nil {
		return fmt.Errorf("gateway %q: not an IP address", id.Gateway)
	}
	if id.Gateway != "" && id.Address == "" {
		return errors.New("gateway without address")
	}
	for _, d := range id.DNS {
		if net.ParseIP(d) == nil {
			return fmt.Errorf("dns %q: not an IP address", d)
		}
	}
	if id.MachineID != "" {
		if _, err := hex.DecodeString(id.MachineID); err != nil || len(id.MachineID) != 32 {
			return fmt.Errorf("machine id %q: want 32 hex digits", id.MachineID)
		}
	}
	for _, h := range id.Hosts {
		if strings.ContainsAny(h, "\n\r") {
			return fmt.Errorf("hosts line %q: contains a newline", h)
		}
	}
	return nil
}

func validHostname(h string) bool {
	if len(h) == 0 || len(h) > 64 {
		return false
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
				return false
			}
		}
	}
	return true
}

// ApplyIdentity re-identifies the guest: its network, and meanwhile its
// hostname and files (the host keeps the box's bridge port closed until
// this returns).
func (s *LinuxSystem) ApplyIdentity(id Identity) error {
	if err := id.Validate(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// The hostname and the network are the calling thread's namespaces':
	// one set in a guest, a test's own where a test moved its thread into
	// fresh ones. Only the files, which name no namespace, are written on
	// another goroutine meanwhile.
	if id.Hostname != "" {
		if err := unix.Sethostname([]byte(id.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	files := make(chan error, 1)
	go func() { files <- applyFiles(s.Root, id) }()
	var err error
	if id.MAC != "" || id.Address != "" {
		err = s.net.apply(id)
		if err == nil {
			s.hasLink.Store(true)
		}
	}
	return errors.Join(err, <-files)
}

// primaryLink is the first non-loopback ethernet link by index.
func primaryLink() (netlink.Link, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	sort.Slice(links, func(i, j int) bool { return links[i].Attrs().Index < links[j].Attrs().Index })
	for _, l := range links {
		a := l.Attrs()
		if a.Flags&net.FlagLoopback != 0 || a.EncapType != "ether" || len(a.HardwareAddr) != 6 {
			continue
		}
		switch l.Type() {
		case "device", "dummy", "veth":
			return l, nil
		}
	}
	return nil, errors.New("no ethernet interface")
}

// apply sets the identity's MAC, address and gateway on the primary link.
// The link is found once and kept, with the MAC this left on it.
func (n *netState) apply(id Identity) error {
	if n.h == nil {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		n.h = h
	}
	if n.link == nil {
		link, err := primaryLink()
		if err != nil {
			return err
		}
		name := link.Attrs().Name
		// No IPv6 on the box's NIC: the host drops all of it at the box's
		// port (network/portfilter.go), so its addresses, router
		// solicitations, duplicate address detection and multicast reports
		// are work for nothing, done again by every clone as it comes up
		// (the loopback keeps ::1). Best effort, as arp_notify: a kernel
		// without IPv6 has no such file.
		os.WriteFile("/proc/sys/net/ipv6/conf/"+name+"/disable_ipv6", []byte("1\n"), 0o644)
		// Announce the address when the link comes up (gratuitous ARP):
		// the host and other boxes may still map it to the MAC of a box
		// that had it before, or to the source of a clone.
		os.WriteFile("/proc/sys/net/ipv4/conf/"+name+"/arp_notify", []byte("1\n"), 0o644)
		n.link, n.mac = link, link.Attrs().HardwareAddr
	}
	err := applyNetwork(n.h, n.link, n.mac, id)
	if hw, _ := net.ParseMAC(id.MAC); err == nil && hw != nil {
		n.mac = hw
	} else if err != nil {
		// What the link has now is unknown, and the socket may hold a
		// late answer: both are made afresh next time.
		n.h.Close()
		n.h, n.link = nil, nil
	}
	return err
}

// applyNetwork changes link, whose MAC is mac, to id's network.
func applyNetwork(h *netlink.Handle, link netlink.Link, mac net.HardwareAddr, id Identity) error {
	name := link.Attrs().Name
	// A clone's new MAC is set while the link is up where the driver can
	// (virtio-net: IFF_LIVE_ADDR_CHANGE): taking the NIC down and up again
	// restarts its queues, the costliest part of a clone's
	// re-identification under TCG. The gratuitous ARP the link's coming up
	// would send is lost for a clone anyway: its port stays closed until
	// its identity is applied. Otherwise (the same MAC, a box's first
	// contact, or a driver that refuses) the link goes down and up.
	hw, _ := net.ParseMAC(id.MAC)
	live := hw != nil && !bytes.Equal(mac, hw) && h.LinkSetHardwareAddr(link, hw) == nil
	if !live {
		if err := h.LinkSetDown(link); err != nil {
			return fmt.Errorf("%s down: %w", name, err)
		}
		if hw != nil {
			if err := h.LinkSetHardwareAddr(link, hw); err != nil {
				return fmt.Errorf("%s set mac: %w", name, err)
			}
		}
	}
	if id.Address != "" {
		addrs, err := h.AddrList(link, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("%s list addresses: %w", name, err)
		}
		for _, a := range addrs {
			if err := h.AddrDel(link, &a); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
				return fmt.Errorf("%s flush %s: %w", name, a.IPNet, err)
			}
		}
		addr, err := netlink.ParseAddr(id.Address)
		if err != nil {
			return fmt.Errorf("address %q: %w", id.Address, err)
		}
		if err := h.AddrReplace(link, addr); err != nil {
			return fmt.Errorf("%s add %s: %w", name, id.Address, err)
		}
	}
	if err := h.LinkSetUp(link); err != nil {
		return fmt.Errorf("%s up: %w", name, err)
	}
	if id.Gateway != "" {
		gw := net.ParseIP(id.Gateway)
		r := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: gw}
		if gw.To4() != nil {
			r.Family = netlink.FAMILY_V4
		} else {
			r.Family = netlink.FAMILY_V6
		}
		if err := h.RouteReplace(r); err != nil {
			return fmt.Errorf("default route via %s: %w", id.Gateway, err)
		}
	}
	return nil
}

// applyFiles rewrites the identity files under root.
func applyFiles(root string, id Identity) error {
	p := func(name string) string { return filepath.Join(root, name) }
	if id.Hostname != "" {
		// A read-only /etc (busybox initramfs) is fine: the kernel has the
		// name already.
		if err := writeFileAtomic(p("etc/hostname"), []byte(id.Hostname+"\n"), 0o644); err != nil && !isReadOnly(err) {
			return err
		}
		var b strings.Builder
		short, _, _ := strings.Cut(id.Hostname, ".")
		fmt.Fprintf(&b, "127.0.0.1\tlocalhost\n127.0.1.1\t%s", id.Hostname)
		if short != id.Hostname {
			fmt.Fprintf(&b, " %s", short)
		}
		b.WriteString("\n::1\tlocalhost ip6-localhost ip6-loopback\n")
		for _, h := range id.Hosts {
			b.WriteString(h + "\n")
		}
		if err := writeFileAtomic(p("etc/hosts"), []byte(b.String()), 0o644); err != nil && !isReadOnly(err) {
			return err
		}
	}
	if id.MachineID != "" {
		if _, err := os.Stat(p("etc/machine-id")); err == nil {
			if err := writeFileAtomic(p("etc/machine-id"), []byte(strings.ToLower(id.MachineID)+"\n"), 0o444); err != nil && !isReadOnly(err) {
				return err
			}
		}
	}
	if len(id.DNS) > 0 {
		var b strings.Builder
		for _, d := range id.DNS {
			fmt.Fprintf(&b, "nameserver %s\n", d)
		}
		// Atomic rename also replaces a symlink to a resolver's stub file.
		if err := writeFileAtomic(p("etc/resolv.conf"), []byte(b.String()), 0o644); err != nil && !isReadOnly(err) {
			return err
		}
	}
	return nil
}

func isReadOnly(err error) bool {
	return errors.Is(err, unix.EROFS) || errors.Is(err, unix.EACCES) || errors.Is(err, os.ErrNotExist)
}

// SetClock sets CLOCK_REALTIME.
func (s *LinuxSystem) SetClock(t time.Time) error {
	ts := unix.NsecToTimespec(t.UnixNano())
	if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
		return fmt.Errorf("clock_settime: %w", err)
	}
	return nil
}

// AddEntropy writes b to /dev/urandom and credits it with RNDADDENTROPY, so
// a clone that starts from the source's RNG state diverges at once.
func (s *LinuxSystem) AddEntropy(b []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		return fmt.Errorf("write /dev/urandom: %w", err)
	}
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(b)+3)
	binary.NativeEndian.PutUint32(info[0:], uint32(len(b)*8))
	binary.NativeEndian.PutUint32(info[4:], uint32(len(b)))
	copy(info[8:], b)
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var errno unix.Errno
	rc.Control(func(fd uintptr) {
		_, _, errno = unix.Syscall(unix.SYS_IOCTL, fd, unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0])))
	})
	if errno != 0 {
		return fmt.Errorf("RNDADDENTROPY: %w", errno)
	}
	return nil
}
