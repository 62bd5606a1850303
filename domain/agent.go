package domain

import (
	"bytes"
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
	"kvbox.dev/kvbox/overlay"
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
	if !filepath.IsAbs(b.Dir) {
		// Never a socket path relative to kvbox's working directory.
		return nil, fmt.Errorf("box %q has no folder in its metadata (not made by kvbox?)", b.Name)
	}
	tokens, err := readAgentTokens(b.Dir)
	if err != nil {
		return nil, fmt.Errorf("box %q: %w", b.Name, err)
	}
	c, err := h.dialToken(ctx, b, tokens[0], true)
	if errors.Is(err, agent.ErrUnauthorized) && len(tokens) == 2 {
		// A kvbox died while it gave the agent a new token: the agent has
		// one of the two.
		c, err = h.dialToken(ctx, b, tokens[1], true)
	}
	if err == nil && len(tokens) == 2 {
		settleAgentToken(b.Dir, c.Token)
	}
	return c, err
}

// dialToken connects to the agent presenting token; without handshake,
// the connection's first call makes it (agent.OpenSerial).
func (h *Host) dialToken(ctx context.Context, b Box, token []byte, handshake bool) (*agent.Client, error) {
	dialVsock, dialSerial := agent.DialVsock, agent.DialSerialToken
	if !handshake {
		dialVsock, dialSerial = agent.OpenVsock, agent.OpenSerial
	}
	if b.Transport == "vsock" && b.VsockCID > 2 && token != nil {
		// Without a token the agent serves nothing over vsock: a box's
		// first contact is over its serial port.
		c, err := dialVsock(ctx, b.VsockCID, token)
		if err == nil || errors.Is(err, agent.ErrUnauthorized) || ctx.Err() != nil {
			return c, err
		}
		// Nobody on the agent's vsock port: an agent older than that
		// port (it listens on 1024, where any guest user could listen
		// too, so kvbox never dials it) or one that is restarting. Its
		// serial ports serve it, root's on the host and the agent's in
		// the guest.
	}
	var paths []string
	for _, p := range AgentSockets(b.Dir) {
		paths = append(paths, p.Path)
	}
	c, err := dialSerial(ctx, paths, token)
	if errors.Is(err, agent.ErrBusy) {
		return nil, fmt.Errorf("box %q: %v (other kvbox commands use them all; try again when one ends): %w", b.Name, err, ErrBusy)
	}
	return c, err
}

// WaitAgent dials the box's agent until it answers or ctx ends, and returns
// the client and the guest's boot_id ("" if the agent does not say). An
// agent that took the box's token at the dial has answered, with its
// boot_id; otherwise (a first contact, an agent older than that) a ping is
// the answer. It gives up early when the domain stops running.
func (h *Host) WaitAgent(ctx context.Context, d *libvirt.Domain, b Box) (*agent.Client, string, error) {
	return h.waitAgent(ctx, d, b, func() (*agent.Client, string, bool, error) {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		c, err := h.Dial(actx, Box{Name: b.Name, State: "running", Meta: b.Meta, VsockCID: b.VsockCID})
		if errors.Is(err, agent.ErrUnauthorized) {
			return nil, "", false, fmt.Errorf("the agent of box %q refused kvbox's token: %w", b.Name, err)
		}
		if err != nil {
			return nil, "", true, err
		}
		if err := silent(c, b); err != nil {
			return nil, "", true, err
		}
		if c.BootID != "" {
			return c, c.BootID, false, nil
		}
		info, err := c.Ping(actx)
		if err != nil {
			c.Close()
			return nil, "", true, err
		}
		return c, info.BootID, false, nil
	})
}

// WaitAgentIdentify is WaitAgent and Reidentify in one round trip, for a
// box whose agent runs already (a clone's, restored with its memory): the
// HELLO, the token and the box's identity go in one write, and the agent
// applies the identity as soon as it took the token, while its answers to
// the HELLO and the token are on their way. It returns the client and the
// guest's boot_id ("" if the agent does not say); the caller checks that.
func (h *Host) WaitAgentIdentify(ctx context.Context, d *libvirt.Domain, b Box, newToken bool) (*agent.Client, string, error) {
	tokens, err := readAgentTokens(b.Dir)
	if err != nil {
		return nil, "", fmt.Errorf("box %q: %w", b.Name, err)
	}
	return h.waitAgent(ctx, d, b, func() (*agent.Client, string, bool, error) {
		c, err := h.dialToken(ctx, Box{Name: b.Name, State: "running", Meta: b.Meta, VsockCID: b.VsockCID}, tokens[0], false)
		if err != nil {
			return nil, "", true, err
		}
		if err := silent(c, b); err != nil {
			return nil, "", true, err
		}
		err = h.Reidentify(ctx, c, b, newToken)
		if err == nil {
			return c, c.BootID, false, nil
		}
		c.Close()
		var re *agent.RemoteError
		switch {
		case errors.Is(err, agent.ErrUnauthorized):
			return nil, "", false, fmt.Errorf("the agent of box %q refused kvbox's token: %w", b.Name, err)
		case errors.As(err, &re):
			return nil, "", false, err // it answered: no
		}
		return nil, "", true, err // the connection broke (QEMU gone?) or the time is up
	})
}

// waitAgent runs try until it gives a client or an error that is final,
// or ctx ends, or the domain stops running.
func (h *Host) waitAgent(ctx context.Context, d *libvirt.Domain, b Box, try func() (c *agent.Client, bootID string, again bool, err error)) (*agent.Client, string, error) {
	closeBoxDir(b.Dir) // QEMU has made its sockets by now
	var last error
	for {
		if st, _, err := d.GetState(); err == nil && st != libvirt.DOMAIN_RUNNING && st != libvirt.DOMAIN_PAUSED {
			return nil, "", fmt.Errorf("box %q stopped while booting (%s); its console log is kept in %s", b.Name, stateName(st), h.FailedConsoleLog(b.Name))
		}
		c, bootID, again, err := try()
		if !again {
			return c, bootID, err
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, "", fmt.Errorf("the agent of box %q did not answer in time (last error: %s); is kvbox-agent in the image? its console log is kept in %s",
				b.Name, strings.ReplaceAll(fmt.Sprint(last), "\n", "; "), h.FailedConsoleLog(b.Name))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// silent closes c and says so when the tests take b's agent as silent
// (SilentAgentEnv).
func silent(c *agent.Client, b Box) error {
	if !silentAgent(b.Name) {
		return nil
	}
	c.Close()
	return fmt.Errorf("%s names this box: its agent is taken as silent", SilentAgentEnv)
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

// Reidentify gives the guest its identity, sets its clock to the host's,
// feeds its RNG fresh entropy and gives its agent the box's token, in one
// round trip. With newToken (a box's first contact, a clone: its agent has
// no token, or its snapshot's), the box gets a token of its own: written
// beside the old one first, then put in its place once the agent took it
// (ReadAgentToken still finds it if kvbox dies in between).
func (h *Host) Reidentify(ctx context.Context, c *agent.Client, b Box, newToken bool) error {
	seed := make([]byte, 64)
	if _, err := rand.Read(seed); err != nil {
		return err
	}
	token := c.Token
	if newToken || token == nil {
		token = make([]byte, agent.TokenSize)
		if _, err := rand.Read(token); err != nil {
			return err
		}
		if err := overlay.WriteFileAtomic(agentTokenPath(b.Dir)+".new", token, 0o600); err != nil {
			return fmt.Errorf("box %q: keep its agent token: %w", b.Name, err)
		}
	}
	if err := c.Reidentify(ctx, h.Identity(b), time.Now(), seed, token); err != nil {
		return fmt.Errorf("box %q: %w", b.Name, err)
	}
	if !bytes.Equal(token, c.Token) {
		if err := os.Rename(agentTokenPath(b.Dir)+".new", agentTokenPath(b.Dir)); err != nil {
			return fmt.Errorf("box %q: keep its agent token: %w", b.Name, err)
		}
		c.Token = token
	}
	return nil
}

// AgentTokenFile is the name of a box's agent token in its folder (and of
// a snapshot's, the token of the agent in its memory).
const AgentTokenFile = "agent.token"

func agentTokenPath(dir string) string { return filepath.Join(dir, AgentTokenFile) }

// ReadAgentToken is the token of the agent of the box (or snapshot) in dir;
// nil when it has none (a box an older kvbox made, or not yet contacted).
func ReadAgentToken(dir string) ([]byte, error) {
	ts, err := readAgentTokens(dir)
	return ts[0], err
}

// readAgentTokens are the tokens the agent may have: the box's, or first a
// new one a kvbox was giving it when it died (agent.token.new) and then
// the box's. Never empty: [nil] without any.
func readAgentTokens(dir string) ([][]byte, error) {
	var out [][]byte
	for _, p := range []string{agentTokenPath(dir) + ".new", agentTokenPath(dir)} {
		b, err := readNoFollow(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return [][]byte{nil}, fmt.Errorf("agent token: %w", err)
		}
		if len(b) != agent.TokenSize {
			return [][]byte{nil}, fmt.Errorf("agent token %s: %d bytes, not %d", p, len(b), agent.TokenSize)
		}
		out = append(out, b)
	}
	if len(out) == 0 {
		out = append(out, nil)
	}
	return out, nil
}

// settleAgentToken keeps the token the agent took and drops the other.
func settleAgentToken(dir string, took []byte) {
	if b, err := readNoFollow(agentTokenPath(dir) + ".new"); err == nil && bytes.Equal(b, took) {
		os.Rename(agentTokenPath(dir)+".new", agentTokenPath(dir))
		return
	}
	os.Remove(agentTokenPath(dir) + ".new")
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
