package kvbox

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/statedir"
	"kvbox.dev/kvbox/templates"
)

// Config is how a Host is opened: what the CLI's global flags say.
type Config struct {
	// URI is libvirt's (domain.DefaultURI when empty).
	URI string
	// StateDir is where kvbox keeps boxes, images and snapshots
	// (statedir.Default when empty); made absolute.
	StateDir string
	// Template is a file with the domain XML template boxes are defined
	// from ("": the built-in one).
	Template string
	// DomainType forces libvirt's domain type: kvm or qemu ("" or "auto":
	// kvm where the host offers it).
	DomainType string
	// Network is the bridge and subnet boxes are put on
	// (network.Default when its bridge is empty).
	Network network.Config
	// DialTimeout bounds reaching a box's agent, dial and handshake (15s
	// when 0).
	DialTimeout time.Duration
	// Notify is told what Open's recovery did or could not do, and what
	// else a front should show; nil drops it.
	Notify func(Notice)
	// ReaperCommand is the command that runs RunReaper for KIND NAME ID
	// detached (the CLI re-runs itself as `kvbox ... __reap KIND NAME ID`);
	// nil starts no reapers: a deadline is then kept only by Sweep.
	ReaperCommand func(kind, name, id string) *exec.Cmd
	// HolderCommand is the command that serves a box's published ports
	// detached (the CLI's `kvbox port-forward --listen-fds`), taking the
	// listeners as fds 3.. and writing "ok" or "error: ..." on fd readyFD
	// once it forwards; nil refuses to publish.
	HolderCommand func(box string, ports []Port, readyFD int) *exec.Cmd
	// ProxyCommand is the command that runs RunEgressProxy detached for
	// this state dir (the CLI's `kvbox __egress-proxy`), writing "ok" or
	// "error: ..." on fd readyFD once it serves; nil starts none, and a box
	// with an egress policy is then refused.
	ProxyCommand func(readyFD int) *exec.Cmd
	// NoSweep opens without removing what expired (a reaper's Host).
	NoSweep bool
}

// Notice is something Open did or could not do (a half-done creation
// removed, an expired box reaped, a warning).
type Notice struct {
	Warning bool
	Text    string
}

// Host is kvbox on one libvirt host and state directory.
type Host struct {
	cfg    Config
	d      *domain.Host
	layout statedir.Layout
	snaps  snapshot.Store
	images image.Store

	fwdMu sync.Mutex
	fwds  map[string]*sharedForwarder // by box name (forward.go)

	checkedMu sync.Mutex
	checked   map[string]bool // snapshots CheckHostFor passed, by name@creation
}

// Open checks cfg, connects to libvirt, secures the state directory,
// finishes what a killed kvbox left half-done and, unless cfg.NoSweep,
// removes what expired; each thing it did or could not do reaches
// cfg.Notify. kvbox manages bridges and libvirt domains: it runs as root.
// The lock waits of the Host end when ctx ends.
func Open(ctx context.Context, cfg Config) (*Host, error) {
	h, err := newHost(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := h.d.SecureStateDir(); err != nil {
		h.Close()
		return nil, fmt.Errorf("state dir %s: %w", h.cfg.StateDir, err)
	}
	h.recover(ctx)
	if !cfg.NoSweep {
		h.Sweep(ctx)
	}
	// The egress proxy runs while a box has a policy: a kvbox command
	// starts it again should it have ended.
	if cfg.ProxyCommand != nil && h.needsEgressProxy() {
		if err := h.EnsureEgressProxy(); err != nil {
			h.notify(true, "%v", err)
		}
	}
	return h, nil
}

// newHost is Open up to the connection.
func newHost(ctx context.Context, cfg Config) (*Host, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	tmpl := templates.Box
	if cfg.Template != "" {
		b, err := os.ReadFile(cfg.Template)
		if err != nil {
			return nil, base.Errorf(base.Invalid, "template: %v", err)
		}
		tmpl = string(b)
	}
	if os.Geteuid() != 0 {
		return nil, base.Errorf(base.Unavailable, "kvbox manages bridges and libvirt domains: run it as root")
	}
	// Nothing kvbox or its children (qemu-img) create gets world bits.
	syscall.Umask(0o027)
	if err := os.MkdirAll(cfg.StateDir, statedir.RootMode); err != nil {
		return nil, err
	}
	conn, err := domain.Connect(cfg.URI)
	if err != nil {
		return nil, err
	}
	d := &domain.Host{URI: cfg.URI, StateDir: cfg.StateDir, Net: cfg.Network, Template: tmpl,
		DomainTypeOverride: cfg.DomainType, Interrupt: ctx.Done()}
	d.SetConn(conn)
	l := d.Layout()
	return &Host{cfg: cfg, d: d, layout: l, snaps: snapshot.Store{Dir: l.Snapshots()}, images: image.Store{Dir: l.Images()},
		fwds: map[string]*sharedForwarder{}}, nil
}

// fill puts the defaults in and checks what is given.
func (c *Config) fill() error {
	if c.URI == "" {
		c.URI = domain.DefaultURI()
	}
	if c.StateDir == "" {
		c.StateDir = statedir.Default
	}
	for _, p := range []*string{&c.StateDir, &c.Template} {
		if *p == "" || filepath.IsAbs(*p) {
			continue
		}
		abs, err := filepath.Abs(*p)
		if err != nil {
			return base.Errorf(base.Invalid, "%q is relative and the working directory cannot be read (%v): give an absolute path", *p, err)
		}
		*p = abs
	}
	switch c.DomainType {
	case "auto":
		c.DomainType = ""
	case "", "kvm", "qemu":
	default:
		return base.Errorf(base.Invalid, "--domain-type %q: give auto, kvm or qemu", c.DomainType)
	}
	if c.Network.Bridge == "" {
		c.Network = network.Default
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = 15 * time.Second
	}
	return nil
}

// Close ends the Host's agent connections and its libvirt connection.
func (h *Host) Close() error {
	h.fwdMu.Lock()
	for name, f := range h.fwds {
		f.close()
		delete(h.fwds, name)
	}
	h.fwdMu.Unlock()
	return h.d.Close()
}

// StateDir is the Host's state directory, absolute.
func (h *Host) StateDir() string { return h.cfg.StateDir }

// Network is the bridge and subnet the Host puts boxes on.
func (h *Host) Network() network.Config { return h.cfg.Network }

// notify tells the front, if it listens.
func (h *Host) notify(warning bool, format string, a ...any) {
	if h.cfg.Notify != nil {
		h.cfg.Notify(Notice{Warning: warning, Text: fmt.Sprintf(format, a...)})
	}
}

// Domain is the Host's libvirt side, for the bench's peers (the files
// virsh writes given to QEMU, the agent of a box virsh started again); no
// front uses it, and nothing kvbox does is timed through it.
func (h *Host) Domain() *domain.Host { return h.d }
