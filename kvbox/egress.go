package kvbox

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/egress"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/snapshot"
)

// A box's egress policy (package egress): given at Create or Clone
// (CreateRequest.Egress, CloneRequest.Egress), replaced whole while it
// runs (SetEgress), shown with what was refused lately (Egress). Address
// rules are the kernel's (package network); names are matched by kvbox's
// egress proxy, one detached process per state dir (Config.ProxyCommand,
// the CLI's `kvbox __egress-proxy`), started by kvbox on demand as its
// reapers are and again by any kvbox command that finds it gone while a
// box has a policy. It holds nothing of its own: it reads each box's file
// (egress.BoxFile) at every connection, so a restarted proxy lost nothing.

// EgressProxyArg is the hidden command that runs the egress proxy
// (RunEgressProxy).
const EgressProxyArg = "__egress-proxy"

// EgressStatus is a box's policy and what it did lately.
type EgressStatus struct {
	Box    string        `json:"box"`
	Policy egress.Policy `json:"policy"`
	// InForce: the kernel holds the box's rules (a box without a policy
	// has none to hold).
	InForce bool `json:"in_force"`
	// Dropped counts the packets to denied addresses dropped since the
	// rules were last set.
	Dropped uint64 `json:"dropped_packets"`
	// Refused are the proxy's and the resolver's last refusals.
	Refused []string `json:"refused,omitempty"`
	// ProxyRunning: the state dir's egress proxy runs.
	ProxyRunning bool `json:"proxy_running"`
}

// Egress is box name's egress status.
func (h *Host) Egress(ctx context.Context, name string) (EgressStatus, error) {
	b, err := h.d.Get(name)
	if err != nil {
		return EgressStatus{}, err
	}
	return h.egressStatus(b), nil
}

func (h *Host) egressStatus(b domain.Box) EgressStatus {
	st := EgressStatus{Box: b.Name, ProxyRunning: h.egressProxyAlive()}
	if b.Egress != nil {
		st.Policy = *b.Egress
	}
	if b.IP != "" && !st.Policy.IsZero() {
		st.InForce = network.HasEgress(b.Addr())
		st.Dropped, _ = network.EgressDropped(b.Addr())
		st.Refused = egress.Refused(h.cfg.StateDir, b.Name, 20)
	}
	return st
}

// SetEgress replaces box name's egress policy whole (the zero Policy: none)
// while it runs: new connections meet the new one at once; the box is
// neither paused nor restarted. It is in the box's definition from then on.
func (h *Host) SetEgress(ctx context.Context, name string, p egress.Policy) (EgressStatus, error) {
	if err := h.ensureEgressFor(&p); err != nil {
		return EgressStatus{}, err
	}
	if hasHeaders(&p) {
		// Trusted before the proxy serves the box's names with it.
		if err := h.trustEgressCA(ctx, name); err != nil {
			return EgressStatus{}, err
		}
	}
	b, err := h.d.SetEgress(ctx, name, &p)
	if err != nil {
		return EgressStatus{}, err
	}
	return h.egressStatus(b), nil
}

// checkEgress checks a request's policy (nil: none asked).
func checkEgress(p *egress.Policy) error {
	if p == nil {
		return nil
	}
	return p.Validate()
}

func (h *Host) egressLock() string { return filepath.Join(egress.Dir(h.cfg.StateDir), "proxy.lock") }

// EgressProxyLog is where the egress proxy writes what it refused and
// what failed.
func (h *Host) EgressProxyLog() string { return filepath.Join(h.layout.Logs(), "egress-proxy.log") }

func (h *Host) egressProxyAlive() bool {
	l, err := base.LockExisting(h.egressLock())
	if errors.Is(err, base.ErrLocked) {
		return true
	}
	if err == nil {
		l.Unlock()
	}
	return false
}

// needsEgressProxy says whether a box of this state dir has a policy.
func (h *Host) needsEgressProxy() bool {
	bs, _ := egress.Boxes(h.cfg.StateDir)
	return len(bs) > 0
}

// EnsureEgressProxy starts the state dir's egress proxy unless it runs,
// and waits until it serves.
func (h *Host) EnsureEgressProxy() error {
	if h.egressProxyAlive() {
		return nil
	}
	if h.cfg.ProxyCommand == nil {
		return base.Errorf(base.Unavailable, "this kvbox front cannot start the egress proxy (no ProxyCommand): a policy's names and DNS would not be served")
	}
	if err := os.MkdirAll(h.layout.Logs(), 0o750); err != nil {
		return err
	}
	logf, err := os.OpenFile(h.EgressProxyLog(), os.O_WRONLY|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("egress proxy log: %w", err)
	}
	defer logf.Close()
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	defer r.Close()
	cmd := h.cfg.ProxyCommand(3)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, logf, logf
	cmd.ExtraFiles = []*os.File{w}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	w.Close()
	if err != nil {
		return fmt.Errorf("start the egress proxy: %w", err)
	}
	go cmd.Wait()
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(r).ReadString('\n')
		line <- strings.TrimSpace(s)
	}()
	select {
	case s := <-line:
		if s == "ok" {
			return nil
		}
		if s == "" {
			s = "it ended at once"
		}
		return fmt.Errorf("the egress proxy did not start: %s (see %s)", strings.TrimPrefix(s, "error: "), h.EgressProxyLog())
	case <-time.After(30 * time.Second):
		return fmt.Errorf("the egress proxy did not say it serves in 30s (see %s)", h.EgressProxyLog())
	}
}

// RunEgressProxy is the egress proxy of state dir root, a supervisor: it
// takes the proxy's lock (one runs: another that finds it taken says ok
// and ends), starts worker (the command that runs ServeEgressProxy,
// writing "ok" or "error: ..." on fd readyFD once it serves) and starts it
// again whenever it ends, until ctx ends. It writes "ok" or "error: ..."
// on ready once the first worker serves.
func RunEgressProxy(ctx context.Context, root string, worker func(readyFD int) *exec.Cmd, ready io.WriteCloser, logw io.Writer) error {
	defer ready.Close()
	said := false
	say := func(s string) {
		if !said {
			fmt.Fprintln(ready, s)
			ready.Close()
			said = true
		}
	}
	if err := os.MkdirAll(egress.Dir(root), 0o700); err != nil {
		say("error: " + err.Error())
		return err
	}
	l, err := base.Lock(filepath.Join(egress.Dir(root), "proxy.lock"), false)
	if errors.Is(err, base.ErrLocked) {
		say("ok")
		return nil
	}
	if err != nil {
		say("error: " + err.Error())
		return err
	}
	defer l.Unlock()
	l.Note(fmt.Sprint(os.Getpid()))
	lg := newLogger(logw)
	backoff := 100 * time.Millisecond
	for tries := 1; ; tries++ {
		t0 := time.Now()
		line, err := runWorker(ctx, worker, func(line string) {
			if line == "ok" {
				say("ok")
			}
		})
		if !said && tries >= 10 {
			// Tried for seconds (a killed proxy's worker may hold the
			// ports a moment longer): give up.
			say("error: " + strings.TrimPrefix(line, "error: "))
			return fmt.Errorf("egress proxy: %s", line)
		}
		if ctx.Err() != nil {
			return nil
		}
		if said {
			lg.Printf("worker ended (%v): starting another", err)
		}
		if time.Since(t0) > time.Minute {
			backoff = 100 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// runWorker runs one worker until it ends (killed when ctx ends or when
// this process dies), telling ready the line it writes on its ready fd as
// soon as it does, and returns that line.
func runWorker(ctx context.Context, worker func(readyFD int) *exec.Cmd, ready func(string)) (string, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return "error: " + err.Error(), err
	}
	defer r.Close()
	cmd := worker(3)
	cmd.ExtraFiles = []*os.File{w}
	// It dies with its supervisor, whose lock says a proxy runs.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	w.Close()
	if err != nil {
		return "error: " + err.Error(), err
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			cmd.Process.Kill()
		case <-done:
		}
	}()
	s, _ := bufio.NewReader(r).ReadString('\n')
	line := strings.TrimSpace(s)
	ready(line)
	err = cmd.Wait()
	close(done)
	if line == "" {
		line = fmt.Sprintf("error: it ended at once (%v)", err)
	}
	return line, err
}

// ServeEgressProxy is one worker of the egress proxy of state dir root
// (RunEgressProxy starts it): it writes "ok" or "error: ..." on ready
// once it serves, and serves until ctx ends or a listener fails. upstream
// is the DNS server it asks ("": the host's); upstreamCA names a file of
// more CAs its header transforms' connections trust ("": the host's
// roots only).
func ServeEgressProxy(ctx context.Context, root, upstream, upstreamCA string, ready io.WriteCloser, logw io.Writer) error {
	defer ready.Close()
	// The state dir's own ports, chosen once (egress.EnsurePorts): a
	// proxy of another state dir holds others.
	ports, err := egress.EnsurePorts(root, nil)
	if err != nil {
		fmt.Fprintln(ready, "error: "+err.Error())
		return err
	}
	p := &egress.Proxy{StateDir: root, HTTPPort: ports.HTTP, TLSPort: ports.TLS, DNSPort: ports.DNS, Upstream: upstream,
		UpstreamCAFile: upstreamCA, Log: newLogger(logw)}
	started := false
	err = p.Serve(ctx, func() { started = true; fmt.Fprintln(ready, "ok"); ready.Close() })
	if errors.Is(err, syscall.EADDRINUSE) {
		err = fmt.Errorf("%w: another program holds one of this state dir's egress ports (%d, %d, %d, recorded in %s); with no box of the state dir holding an egress policy, remove that file and kvbox chooses others", err, ports.HTTP, ports.TLS, ports.DNS, egress.PortsFile(root))
	}
	if err != nil && !started {
		fmt.Fprintln(ready, "error: "+err.Error())
	}
	return err
}

func newLogger(w io.Writer) *log.Logger { return log.New(w, "egress-proxy ", log.LstdFlags|log.LUTC) }

// ensureEgressFor starts the egress proxy before a box with policy p is
// made, so that its first query is answered.
func (h *Host) ensureEgressFor(p *egress.Policy) error {
	if err := checkEgress(p); err != nil {
		return err
	}
	if p == nil || p.IsZero() {
		return nil
	}
	if err := h.checkSecrets(p); err != nil {
		return err
	}
	if hasHeaders(p) {
		if _, err := egress.EnsureCA(h.cfg.StateDir); err != nil {
			return fmt.Errorf("egress CA: %w", err)
		}
	}
	return h.EnsureEgressProxy()
}

// cloneEgress is the policy a clone of snap gets: asked's, or the
// snapshot's box's.
func (h *Host) cloneEgress(snap snapshot.Snapshot, asked *egress.Policy) *egress.Policy {
	if asked != nil {
		return asked
	}
	data, err := os.ReadFile(snap.Path(snapshot.DomainXMLFile))
	if err != nil {
		return nil
	}
	m, _, err := domain.MetaOfXML(string(data))
	if err != nil {
		return nil
	}
	return m.Egress
}

// SetSecret keeps value as secret name on the host, root's only: header
// transforms name it (${secret:NAME}); it never enters a box.
func (h *Host) SetSecret(name string, value []byte) error {
	return egress.SetSecret(h.cfg.StateDir, name, value)
}

// Secrets lists the secrets' names (never their values).
func (h *Host) Secrets() ([]string, error) { return egress.Secrets(h.cfg.StateDir) }

// RemoveSecret removes secret name; a header that names it fails its
// requests from then on.
func (h *Host) RemoveSecret(name string) error { return egress.RemoveSecret(h.cfg.StateDir, name) }

// checkSecrets refuses a policy whose headers name secrets the host does
// not have.
func (h *Host) checkSecrets(p *egress.Policy) error {
	if p == nil {
		return nil
	}
	for _, hd := range p.Headers {
		if _, err := hd.Resolve(h.cfg.StateDir); err != nil {
			return fmt.Errorf("--header %s:%s: %w", hd.Host, hd.Name, err)
		}
	}
	return nil
}

// caInstall puts the host's egress CA in the guest's trust store (stdin):
// Debian's update-ca-certificates where there is one, the bundle's end
// otherwise.
const caInstall = `set -e
mkdir -p /usr/local/share/ca-certificates
cat > /usr/local/share/ca-certificates/kvbox-egress.crt
if command -v update-ca-certificates >/dev/null 2>&1; then
	update-ca-certificates >/dev/null 2>&1
else
	mkdir -p /etc/ssl/certs
	grep -qF "$(sed -n 2p /usr/local/share/ca-certificates/kvbox-egress.crt)" /etc/ssl/certs/ca-certificates.crt 2>/dev/null ||
		cat /usr/local/share/ca-certificates/kvbox-egress.crt >> /etc/ssl/certs/ca-certificates.crt
fi`

// trustEgressCA makes box name trust the host's egress CA, which its
// header transforms' names are served with.
func (h *Host) trustEgressCA(ctx context.Context, name string) error {
	ca, err := egress.EnsureCA(h.cfg.StateDir)
	if err != nil {
		return fmt.Errorf("egress CA: %w", err)
	}
	var out strings.Builder
	code, err := h.Exec(ctx, name, agent.ExecRequest{Argv: []string{"/bin/sh", "-c", caInstall}, Timeout: 2 * time.Minute},
		strings.NewReader(string(ca)), &out, &out, nil)
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d: %s", code, strings.TrimSpace(out.String()))
	}
	if err != nil {
		return fmt.Errorf("box %q: put the host's egress CA in its trust store: %w", name, err)
	}
	return nil
}

func hasHeaders(p *egress.Policy) bool { return p != nil && len(p.Headers) > 0 }
