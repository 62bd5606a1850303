package egress

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"kvbox.dev/kvbox/base"
)

// The proxy's and resolver's host ports are the state dir's own, so that
// two state dirs (two kvbox instances on one host, each with its own
// bridge) run their proxies at once. They are chosen once, the first time
// a state dir needs them, and recorded in STATE/egress/ports.json: the
// proxy binds them, and every box's redirect (package network) sends its
// connections there. The choice starts at a block of three ports derived
// from the state dir's path, in PortFirst..PortLast (below Linux's
// ephemeral range, so no outgoing connection of the host takes one while
// the proxy is down), and moves on past a block something already holds
// (another state dir's proxy).

// Ports are a proxy's host ports: HTTP and TLS (TCP), DNS (UDP and TCP).
type Ports struct {
	HTTP uint16 `json:"http"`
	TLS  uint16 `json:"tls"`
	DNS  uint16 `json:"dns"`
}

// The range the proxies' ports are chosen in (kvbox's input chain lets a
// box's redirected connections reach this range only).
const (
	PortFirst = 20000
	PortLast  = 32767
)

func (p Ports) valid() bool {
	for _, x := range []uint16{p.HTTP, p.TLS, p.DNS} {
		if x < PortFirst || x > PortLast {
			return false
		}
	}
	return p.HTTP != p.TLS && p.TLS != p.DNS && p.HTTP != p.DNS
}

// PortsFile records state dir root's proxy ports.
func PortsFile(root string) string { return filepath.Join(Dir(root), "ports.json") }

// portBlocks is how many blocks of three ports the range holds.
const portBlocks = (PortLast - PortFirst + 1) / 3

// blockPorts are the ports of block i.
func blockPorts(i int) Ports {
	b := uint16(PortFirst + 3*(i%portBlocks))
	return Ports{HTTP: b, TLS: b + 1, DNS: b + 2}
}

// firstBlock is the block state dir root's choice starts at.
func firstBlock(root string) int {
	abs, err := filepath.Abs(root)
	if err != nil {
		abs = root
	}
	h := fnv.New64a()
	h.Write([]byte(filepath.Clean(abs)))
	return int(h.Sum64() % portBlocks)
}

// RecordedPorts are the ports recorded for state dir root (an error
// wrapping os.ErrNotExist: none yet).
func RecordedPorts(root string) (Ports, error) {
	data, err := os.ReadFile(PortsFile(root))
	if err != nil {
		return Ports{}, err
	}
	var p Ports
	if err := json.Unmarshal(data, &p); err != nil || !p.valid() {
		return Ports{}, base.Errorf(base.Invalid, "%s: not three distinct ports in %d..%d: remove it (no box of this state dir may have an egress policy then) and kvbox chooses again", PortsFile(root), PortFirst, PortLast)
	}
	return p, nil
}

// EnsurePorts are state dir root's proxy ports: the recorded ones, or
// ones chosen now (free is asked whether a block can be bound; nil: bind
// each port here and let go) and recorded.
func EnsurePorts(root string, free func(Ports) bool) (Ports, error) {
	if p, err := RecordedPorts(root); !errors.Is(err, os.ErrNotExist) {
		return p, err
	}
	if err := os.MkdirAll(Dir(root), 0o700); err != nil {
		return Ports{}, err
	}
	l, err := base.Lock(filepath.Join(Dir(root), "ports.lock"), true)
	if err != nil {
		return Ports{}, err
	}
	defer l.Unlock()
	if p, err := RecordedPorts(root); !errors.Is(err, os.ErrNotExist) {
		return p, err
	}
	if free == nil {
		free = PortsFree
	}
	eph := ephemeralRange()
	start := firstBlock(root)
	for i := 0; i < portBlocks; i++ {
		p := blockPorts(start + i)
		if eph.overlaps(p) || !free(p) {
			continue
		}
		data, _ := json.Marshal(p)
		if err := writeFile0600(PortsFile(root), append(data, '\n')); err != nil {
			return Ports{}, fmt.Errorf("record the egress proxy's ports: %w", err)
		}
		return p, nil
	}
	return Ports{}, base.Errorf(base.Unavailable, "egress proxy: no three free ports in %d..%d", PortFirst, PortLast)
}

// PortsFree says whether every port of p can be bound here (TCP on all
// three, UDP on DNS's), on every address as the proxy binds them.
func PortsFree(p Ports) bool { return portsFreeOn("", p) }

func portsFreeOn(addr string, p Ports) bool {
	var closers []func() error
	defer func() {
		for _, c := range closers {
			c()
		}
	}()
	for _, port := range []uint16{p.HTTP, p.TLS, p.DNS} {
		l, err := net.Listen("tcp4", net.JoinHostPort(addr, strconv.Itoa(int(port))))
		if err != nil {
			return false
		}
		closers = append(closers, l.Close)
	}
	u, err := net.ListenPacket("udp4", net.JoinHostPort(addr, strconv.Itoa(int(p.DNS))))
	if err != nil {
		return false
	}
	closers = append(closers, u.Close)
	return true
}

type portRange struct{ lo, hi int }

func (r portRange) overlaps(p Ports) bool {
	for _, x := range []uint16{p.HTTP, p.TLS, p.DNS} {
		if int(x) >= r.lo && int(x) <= r.hi {
			return true
		}
	}
	return false
}

// ephemeralRange is the kernel's range of ports for outgoing connections
// (Linux's default when it cannot be read).
func ephemeralRange() portRange {
	r := portRange{32768, 60999}
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return r
	}
	f := strings.Fields(string(data))
	if len(f) == 2 {
		lo, err1 := strconv.Atoi(f[0])
		hi, err2 := strconv.Atoi(f[1])
		if err1 == nil && err2 == nil && lo <= hi {
			r = portRange{lo, hi}
		}
	}
	return r
}
