package kvbox

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"kvbox.dev/kvbox/base"
)

// Port is one forward of a host port to a port in a box: [ADDR:]HOSTPORT:GUESTPORT.
type Port struct {
	Addr      string `json:"address"` // host address to bind
	HostPort  int    `json:"host_port"`
	GuestPort int    `json:"guest_port"`
}

// ListenAddr is where the host side listens.
func (p Port) ListenAddr() string { return net.JoinHostPort(p.Addr, strconv.Itoa(p.HostPort)) }

// GuestAddr is where the guest side is dialled.
func (p Port) GuestAddr() string { return "127.0.0.1:" + strconv.Itoa(p.GuestPort) }

func (p Port) String() string { return p.ListenAddr() + ":" + strconv.Itoa(p.GuestPort) }

// ParsePort reads [ADDR:]HOSTPORT:GUESTPORT; ADDR is 127.0.0.1 when left
// out, and an IPv6 address goes in brackets ([::1]:8080:80).
func ParsePort(s string) (Port, error) {
	bad := func(why string) (Port, error) {
		return Port{}, base.Errorf(base.Invalid, "port %q: %s (give [ADDR:]HOSTPORT:GUESTPORT, e.g. 8080:8000 or 0.0.0.0:8080:8000)", s, why)
	}
	i := strings.LastIndexByte(s, ':')
	if i < 0 {
		return bad("no guest port")
	}
	gp, err := strconv.Atoi(s[i+1:])
	if err != nil || gp < 1 || gp > 65535 {
		return bad("the guest port must be 1-65535")
	}
	host := s[:i]
	p := Port{Addr: "127.0.0.1", GuestPort: gp}
	hp := host
	if j := strings.LastIndexByte(host, ':'); j >= 0 {
		p.Addr, hp = host[:j], host[j+1:]
		if a, ok := strings.CutPrefix(p.Addr, "["); ok {
			p.Addr, ok = strings.CutSuffix(a, "]")
			if !ok {
				return bad("unbalanced [")
			}
		}
		if net.ParseIP(p.Addr) == nil {
			return bad("the host address must be an IP address")
		}
	}
	p.HostPort, err = strconv.Atoi(hp)
	if err != nil || p.HostPort < 0 || p.HostPort > 65535 {
		return bad("the host port must be 0-65535")
	}
	return p, nil
}

// ParsePorts reads every argument with ParsePort; a host address given
// twice is refused.
func ParsePorts(args []string) ([]Port, error) {
	var ports []Port
	seen := map[string]bool{}
	for _, s := range args {
		p, err := ParsePort(s)
		if err != nil {
			return nil, err
		}
		if p.HostPort != 0 && seen[p.ListenAddr()] {
			return nil, base.Errorf(base.Invalid, "%s is given twice", p.ListenAddr())
		}
		seen[p.ListenAddr()] = true
		ports = append(ports, p)
	}
	return ports, nil
}

// Listen binds every port, or none: on an error the ones bound are closed.
// A port with host port 0 gets the one the kernel picked.

func Listen(ports []Port) ([]*net.TCPListener, error) {
	var ls []*net.TCPListener
	for i, p := range ports {
		l, err := net.Listen("tcp", p.ListenAddr())
		if err != nil {
			closeAll(ls)
			return nil, fmt.Errorf("listen on %s: %w", p.ListenAddr(), errors.Unwrap(err))
		}
		ports[i].HostPort = l.Addr().(*net.TCPAddr).Port
		ls = append(ls, l.(*net.TCPListener))
	}
	return ls, nil
}

// Inherited takes the listening sockets a parent bound and handed over as
// fds 3, 4, ... in the order of ports (a port holder's).
func Inherited(ports []Port) ([]*net.TCPListener, error) {
	var ls []*net.TCPListener
	for i := range ports {
		f := os.NewFile(uintptr(3+i), "listener")
		l, err := net.FileListener(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("inherited listener %d: %w", i, err)
		}
		tl, ok := l.(*net.TCPListener)
		if !ok {
			return nil, fmt.Errorf("inherited listener %d is not TCP", i)
		}
		ports[i].HostPort = tl.Addr().(*net.TCPAddr).Port
		ls = append(ls, tl)
	}
	return ls, nil
}

func closeAll(ls []*net.TCPListener) {
	for _, l := range ls {
		l.Close()
	}
}
