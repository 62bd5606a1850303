package domain

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"libvirt.org/go/libvirt"

	agent "kvbox.dev/kvbox/guest-agent"
)

// AgentSockets are the host ends of a box's agent ports.
func AgentSockets(dir string) []AgentPort {
	var ps []AgentPort
	for i := range AgentPorts {
		ps = append(ps, AgentPort{
			Name: fmt.Sprintf("%s%d", agent.SerialPortPrefix, i),
			Path: filepath.Join(dir, fmt.Sprintf("agent.%d.sock", i)),
		})
	}
	return ps
}

// Dial connects to a box's agent over the box's transport.
func (h *Host) Dial(ctx context.Context, b Box) (*agent.Client, error) {
	if b.State == "paused" {
		return nil, fmt.Errorf("box %q is paused, not running (kvbox start %s resumes it): %w", b.Name, b.Name, ErrBusy)
	}
	if b.State == "suspended" {
		return nil, fmt.Errorf("box %q is suspended, not running (kvbox resume %s wakes it): %w", b.Name, b.Name, ErrBusy)
	}
	if b.State != "running" {
		return nil, fmt.Errorf("box %q is %s, not running (kvbox start %s): %w", b.Name, b.State, b.Name, ErrBusy)
	}
	if b.Transport == "vsock" && b.VsockCID > 2 {
		return agent.DialVsock(ctx, b.VsockCID)
	}
	if !filepath.IsAbs(b.Dir) {
		// Never a socket path relative to kvbox's working directory.
		return nil, fmt.Errorf("box %q has no folder in its metadata (not made by kvbox?)", b.Name)
	}
	var paths []string
	for _, p := range AgentSockets(b.Dir) {
		paths = append(paths, p.Path)
	}
	c, err := agent.DialSerial(ctx, paths)
	if errors.Is(err, agent.ErrBusy) {
		return nil, fmt.Errorf("box %q: %v (other kvbox commands use them all; try again when one ends): %w", b.Name, err, ErrBusy)
	}
	return c, err
}

// WaitAgent dials the box's agent until it answers a ping or ctx ends. It
// gives up early when the domain stops running.
func (h *Host) WaitAgent(ctx context.Context, d *libvirt.Domain, b Box) (*agent.Client, error) {
	closeBoxDir(b.Dir) // QEMU has made its sockets and RAM file by now
	var last error
	for {
		if st, _, err := d.GetState(); err == nil && st != libvirt.DOMAIN_RUNNING && st != libvirt.DOMAIN_PAUSED {
			return nil, fmt.Errorf("box %q stopped while booting (%s); its console log is kept in %s", b.Name, stateName(st), h.FailedConsoleLog(b.Name))
		}
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := h.Dial(actx, Box{Name: b.Name, State: "running", Meta: b.Meta, VsockCID: b.VsockCID})
		if err == nil && silentAgent(b.Name) {
			c.Close()
			err = fmt.Errorf("%s names this box: its agent is taken as silent", SilentAgentEnv)
		}
		if err == nil {
			_, err = c.Ping(actx)
			if err == nil {
				cancel()
				return c, nil
			}
			c.Close()
		}
		cancel()
		last = err
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("the agent of box %q did not answer in time (last error: %s); is kvbox-agent in the image? its console log is kept in %s",
				b.Name, strings.ReplaceAll(fmt.Sprint(last), "\n", "; "), h.FailedConsoleLog(b.Name))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Identity is what the host tells a box's agent about who the box is.
func (h *Host) Identity(b Box) agent.Identity {
	id := agent.Identity{
		Hostname:  b.Name,
		MAC:       b.MAC,
		Address:   fmt.Sprintf("%s/%d", b.IP, b.Prefix),
		Gateway:   b.Gateway,
		DNS:       hostNameservers(),
		MachineID: strings.ReplaceAll(b.UUID, "-", ""),
	}
	if b.IP == "" { // no network (--network none)
		id.MAC, id.Address, id.Gateway, id.DNS = "", "", "", nil
	}
	return id
}

// Reidentify gives the guest its identity, sets its clock to the host's
// and feeds its RNG fresh entropy, in one round trip.
func (h *Host) Reidentify(ctx context.Context, c *agent.Client, b Box) error {
	seed := make([]byte, 64)
	if _, err := rand.Read(seed); err != nil {
		return err
	}
	if err := c.Reidentify(ctx, h.Identity(b), time.Now(), seed); err != nil {
		return fmt.Errorf("box %q: %w", b.Name, err)
	}
	return nil
}

// hostNameservers are the host's resolvers a box can reach through NAT.
// Loopback resolvers (systemd-resolved's stub, a local dnsmasq) are useless
// inside a box; behind systemd-resolved the upstream servers are in its own
// resolv.conf.
func hostNameservers() []string {
	for _, f := range []string{"/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"} {
		if ns := nameservers(f); len(ns) > 0 {
			return ns
		}
	}
	return nil
}

func nameservers(file string) []string {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil
	}
	var ns []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "nameserver" {
			if a, err := netip.ParseAddr(f[1]); err == nil && !a.IsLoopback() {
				ns = append(ns, a.String())
			}
		}
	}
	return ns
}

// SilentAgentEnv names the environment variable (a comma-separated list of
// box names) that makes WaitAgent take those boxes' agents as silent: the
// end-to-end tests use it to give one clone of a --count a late agent and
// prove that it fails alone and leaves nothing.
const SilentAgentEnv = "KVBOX_TEST_SILENT_AGENT"

func silentAgent(name string) bool {
	v := os.Getenv(SilentAgentEnv)
	if v == "" {
		return false
	}
	for _, n := range strings.Split(v, ",") {
		if n == name {
			return true
		}
	}
	return false
}
