package domain

import (
	"bytes"
	"cmp"
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

	"kvbox.dev/kvbox/base"
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
	if b.State == StatePaused {
		return nil, base.Errorf(base.Busy, "box %q is paused, not running (kvbox start %s resumes it)", b.Name, b.Name)
	}
	if b.State == StateSuspended {
		return nil, base.Errorf(base.Busy, "box %q is suspended, not running (kvbox resume %s wakes it)", b.Name, b.Name)
	}
	if b.State != StateRunning {
		return nil, base.Errorf(base.Busy, "box %q is %s, not running (kvbox start %s)", b.Name, b.State, b.Name)
	}
	if !filepath.IsAbs(b.Dir) {
		// Never a socket path relative to kvbox's working directory.
		return nil, fmt.Errorf("box %q has no folder in its metadata (not made by kvbox?)", b.Name)
	}
	tokens, err := readAgentTokens(b.Dir)
	if err != nil {
		return nil, fmt.Errorf("box %q: %w", b.Name, err)
	}
	var c *agent.Client
	var took agentToken
	for _, t := range tokens {
		c, err = h.dialToken(ctx, b, t.tok, true, t.kind == tokenSnapshot || t.kind == tokenOld)
		took = t
		if !errors.Is(err, agent.ErrUnauthorized) {
			break
		}
		// The agent has another of them: a kvbox died while it gave the
		// agent a new token, or during a snapshot of the box.
	}
	if err == nil && (unsettled(tokens) || took.kind != tokenCurrent) {
		h.settleAgentToken(ctx, b, c, took.kind)
	}
	return c, err
}

// dialToken connects to the agent presenting token; without handshake,
// the connection's first call makes it (agent.OpenSerial). A snapshot's
// token (serial) is presented on a virtio-serial port only: the agent
// serves it nowhere else.
func (h *Host) dialToken(ctx context.Context, b Box, token []byte, handshake, serial bool) (*agent.Client, error) {
	dialVsock, dialSerial := agent.DialVsock, agent.DialSerialToken
	if !handshake {
		dialVsock, dialSerial = agent.OpenVsock, agent.OpenSerial
	}
	if b.Transport == "vsock" && b.VsockCID > 2 && token != nil && !serial {
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
		return nil, base.Errorf(base.Busy, "box %q: %v (other kvbox commands use them all; try again when one ends)", b.Name, err)
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
		c, err := h.Dial(actx, Box{Name: b.Name, State: StateRunning, Meta: b.Meta, VsockCID: b.VsockCID})
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
func (h *Host) WaitAgentIdentify(ctx context.Context, d *libvirt.Domain, b Box, newToken bool, extra ...agent.Call) (*agent.Client, string, error) {
	tokens, err := readAgentTokens(b.Dir)
	if err != nil {
		return nil, "", fmt.Errorf("box %q: %w", b.Name, err)
	}
	return h.waitAgent(ctx, d, b, func() (*agent.Client, string, bool, error) {
		// A clone's agent has its snapshot's token, which it serves on a
		// virtio-serial port only.
		c, err := h.dialToken(ctx, Box{Name: b.Name, State: StateRunning, Meta: b.Meta, VsockCID: b.VsockCID}, tokens[0].tok, false, newToken)
		if err != nil {
			return nil, "", true, err
		}
		if err := silent(c, b); err != nil {
			return nil, "", true, err
		}
		err = h.Reidentify(ctx, c, b, newToken, extra...)
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
			return nil, "", fmt.Errorf("box %q stopped while booting (%s); its console log is kept in %s", b.Name, stateOf(st, false), h.Layout().FailedConsoleLog(b.Name))
		}
		c, bootID, again, err := try()
		if !again {
			return c, bootID, err
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, "", fmt.Errorf("the agent of box %q did not answer in time (last error: %s); is kvbox-agent in the image? its console log is kept in %s",
				b.Name, strings.ReplaceAll(fmt.Sprint(last), "\n", "; "), h.Layout().FailedConsoleLog(b.Name))
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
		Hostname:  cmp.Or(b.Hostname, b.Name),
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
// no token, or its snapshot's), or when the agent took a token that was
// copied (a snapshot's, agent.token.snapshot), the box gets a token of its
// own: written beside the old one first, then put in its place once the
// agent took it (Dial still finds it if kvbox dies in between). The caller
// holds the box's lock. Extra calls go in the same round trip (Creation.Extra).
func (h *Host) Reidentify(ctx context.Context, c *agent.Client, b Box, newToken bool, extra ...agent.Call) error {
	seed := make([]byte, 64)
	if _, err := rand.Read(seed); err != nil {
		return err
	}
	token := c.Token
	if newToken || token == nil || isSnapshotToken(b.Dir, token) {
		var err error
		if token, err = newAgentToken(b); err != nil {
			return err
		}
	}
	if err := c.Reidentify(ctx, h.Identity(b), time.Now(), seed, token, extra...); err != nil {
		return fmt.Errorf("box %q: %w", b.Name, err)
	}
	if !bytes.Equal(token, c.Token) {
		if err := keepNewToken(b); err != nil {
			return err
		}
		c.Token = token
	}
	return nil
}

// AgentTokenFile is the name of a box's agent token in its folder (and of
// a snapshot's, the token of the agent in its memory). Beside it in a box's
// folder: agent.token.new, a token being given to the agent, and
// agent.token.snapshot, a token minted for a snapshot of the box, which
// the agent has from just before the snapshot's memory is copied until
// kvbox gives it a new one of its own right after. Each is one the agent
// may have when a kvbox died in between; a box whose agent has the
// snapshot's token gets a new one at its next contact. agent.token.old is
// the token the agent had before its current one, which it may find on its
// disk again when the box lost power before the guest wrote its new one
// (an agent older than its synced token file): tried last, on the serial
// port only, and replaced at once.
const AgentTokenFile = "agent.token"

func agentTokenPath(dir string) string { return filepath.Join(dir, AgentTokenFile) }

const (
	tokenNew      = ".new"
	tokenSnapshot = ".snapshot"
	tokenCurrent  = ""
	tokenOld      = ".old"
)

// agentToken is a token the agent may have and which file it is in.
type agentToken struct {
	tok  []byte
	kind string // tokenNew, tokenSnapshot, tokenCurrent or tokenOld
}

// ReadAgentToken is the token of the agent of the box (or snapshot) in dir;
// nil when it has none (a box not yet contacted).
func ReadAgentToken(dir string) ([]byte, error) {
	ts, err := readAgentTokens(dir)
	return ts[0].tok, err
}

// AgentTokens are the tokens the agent of the box in dir may have, the
// likeliest first (see AgentTokenFile): for a connection that lost its
// rights when the box's token changed.
func AgentTokens(dir string) [][]byte {
	ts, _ := readAgentTokens(dir)
	var out [][]byte
	for _, t := range ts {
		if t.tok != nil && t.kind != tokenOld {
			out = append(out, t.tok)
		}
	}
	return out
}

// readAgentTokens are the tokens the agent may have: a new one a kvbox
// was giving it, a snapshot's, the box's, then its previous one. Never
// empty: [nil] without any.
func readAgentTokens(dir string) ([]agentToken, error) {
	var out []agentToken
	for _, kind := range []string{tokenNew, tokenSnapshot, tokenCurrent, tokenOld} {
		p := agentTokenPath(dir) + kind
		b, err := readNoFollow(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return []agentToken{{}}, fmt.Errorf("agent token: %w", err)
		}
		if len(b) != agent.TokenSize {
			return []agentToken{{}}, fmt.Errorf("agent token %s: %d bytes, not %d", p, len(b), agent.TokenSize)
		}
		out = append(out, agentToken{b, kind})
	}
	if len(out) == 1 && out[0].kind == tokenOld {
		// A previous token alone is a folder kvbox never leaves.
		out = nil
	}
	if len(out) == 0 {
		out = append(out, agentToken{kind: tokenCurrent})
	}
	return out, nil
}

// unsettled reports whether the box's folder holds a new or a snapshot's
// token beside its own: a kvbox died while it changed them.
func unsettled(tokens []agentToken) bool {
	for _, t := range tokens {
		if t.kind == tokenNew || t.kind == tokenSnapshot {
			return true
		}
	}
	return false
}

// isSnapshotToken reports whether tok is the snapshot's token kept in the
// box folder dir.
func isSnapshotToken(dir string, tok []byte) bool {
	b, err := readNoFollow(agentTokenPath(dir) + tokenSnapshot)
	return err == nil && tok != nil && bytes.Equal(b, tok)
}

// newAgentToken mints a token for box b and keeps it beside the box's
// (agent.token.new) until the agent took it (keepNewToken).
func newAgentToken(b Box) ([]byte, error) {
	tok := make([]byte, agent.TokenSize)
	if _, err := rand.Read(tok); err != nil {
		return nil, err
	}
	if err := overlay.WriteFileAtomic(agentTokenPath(b.Dir)+tokenNew, tok, 0o600); err != nil {
		return nil, fmt.Errorf("box %q: keep its agent token: %w", b.Name, err)
	}
	return tok, nil
}

// keepNewToken makes the token the agent took (agent.token.new) the box's,
// keeps the one it replaces as the previous one, and drops a snapshot's.
func keepNewToken(b Box) error {
	p := agentTokenPath(b.Dir)
	os.Remove(p + tokenOld)
	if err := os.Link(p, p+tokenOld); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("box %q: keep its previous agent token: %w", b.Name, err)
	}
	if err := os.Rename(agentTokenPath(b.Dir)+tokenNew, agentTokenPath(b.Dir)); err != nil {
		return fmt.Errorf("box %q: keep its agent token: %w", b.Name, err)
	}
	os.Remove(agentTokenPath(b.Dir) + tokenSnapshot)
	return nil
}

// renewAgentToken gives box b's agent, through c, a token of its own that
// has never been anywhere but here: after a snapshot, for an agent that
// took a snapshot's. The caller holds the box's lock.
func renewAgentToken(ctx context.Context, c *agent.Client, b Box) error {
	tok, err := newAgentToken(b)
	if err != nil {
		return err
	}
	if _, err := c.SetToken(ctx, tok, false); err != nil {
		if errors.Is(err, agent.ErrNoTokens) {
			os.Remove(agentTokenPath(b.Dir) + tokenNew)
			return nil
		}
		return fmt.Errorf("box %q: give its agent a new token: %w", b.Name, err)
	}
	return keepNewToken(b)
}

// settleAgentToken tidies the box's token files once its agent took one of
// them (kind), if no other kvbox holds the box (one that does, a snapshot
// say, is changing them): a new one becomes the box's, a snapshot's is
// replaced by a new one at once, and the box's own leaves the others
// stale.
func (h *Host) settleAgentToken(ctx context.Context, b Box, c *agent.Client, kind string) {
	l, err := h.TryLockBox(b.Name)
	if err != nil {
		return
	}
	defer l.Unlock()
	switch kind {
	case tokenNew:
		keepNewToken(b)
	case tokenSnapshot, tokenOld:
		renewAgentToken(ctx, c, b)
	default:
		os.Remove(agentTokenPath(b.Dir) + tokenNew)
		os.Remove(agentTokenPath(b.Dir) + tokenSnapshot)
	}
}

// GiveSnapshotToken mints a token for a snapshot of box b and makes it the
// agent's through c, before the snapshot copies the box's memory: the
// token frozen into the snapshot is then one no box keeps (its clones
// replace it at their first contact, and RenewAgentToken the box's right
// after the copy), which the snapshot may carry to other hosts. It is kept
// in b's folder meanwhile, so that the box stays reachable if kvbox dies.
// The agent's info comes in the same round trip. An agent that predates
// tokens is refused: no clone of the snapshot could be reached. The
// caller holds the box's lock.
func (h *Host) GiveSnapshotToken(ctx context.Context, c *agent.Client, b Box) ([]byte, agent.Info, error) {
	tok := make([]byte, agent.TokenSize)
	if _, err := rand.Read(tok); err != nil {
		return nil, agent.Info{}, err
	}
	if err := overlay.WriteFileAtomic(agentTokenPath(b.Dir)+tokenSnapshot, tok, 0o600); err != nil {
		return nil, agent.Info{}, fmt.Errorf("box %q: keep the snapshot's agent token: %w", b.Name, err)
	}
	info, err := c.SetToken(ctx, tok, true)
	if errors.Is(err, agent.ErrNoTokens) {
		os.Remove(agentTokenPath(b.Dir) + tokenSnapshot)
		return nil, info, base.Errorf(base.Invalid, "box %q: its agent takes no tokens, and a clone's first contact presents the snapshot's: build its image again with this kvbox's agent (kvbox images build --force)", b.Name)
	}
	if err != nil {
		return nil, info, fmt.Errorf("box %q: give its agent the snapshot's token: %w", b.Name, err)
	}
	return tok, info, nil
}

// RenewAgentToken gives box b's agent a new token of its own (after a
// snapshot of it). The caller holds the box's lock.
func (h *Host) RenewAgentToken(ctx context.Context, b Box) error {
	c, err := h.Dial(ctx, b)
	if err != nil {
		return fmt.Errorf("box %q: reach its agent to give it a new token: %w", b.Name, err)
	}
	defer c.Close()
	return renewAgentToken(ctx, c, b)
}

// ReprobeBalloon asks the box's agent to have the guest's balloon driver
// take its device again (agent.FeatureReprobeBalloon), so that it agrees
// to the features the device offers now (a clone's, free page hints).
func (h *Host) ReprobeBalloon(ctx context.Context, b Box) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	a, err := h.Dial(ctx, b)
	if err != nil {
		return err
	}
	defer a.Close()
	// Asked without a ping first: an agent without the request answers
	// that it does not know it.
	return a.ReprobeBalloon(ctx)
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
