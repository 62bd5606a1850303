// Package libadapter is kvbox-node's Library over the kvbox library: each
// method is the library call of the same name, its types and error kinds
// put in kvboxnode's words. Nothing is done here that the library does not
// do for the CLI and kvbox serve too.
package libadapter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"

	"kvbox.dev/kvbox/base"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/snapshot"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
)

// Config is the host: libvirt, the state dir, the domain type.
type Config struct {
	URI, StateDir string
	DomainType    string // kvm, qemu, or "" for kvm where the host offers it
	// AgentTimeout bounds a clone's or a start's wait for its agent.
	AgentTimeout time.Duration
}

// Opener returns kvboxnode's OpenFunc for c.
func Opener(c Config) kvboxnode.OpenFunc {
	return func(ctx context.Context, n network.Config) (kvboxnode.Library, error) { return open(ctx, c, n) }
}

type host struct {
	k       *kvbox.Host
	timeout time.Duration
}

func open(ctx context.Context, c Config, n network.Config) (*host, error) {
	if c.AgentTimeout <= 0 {
		c.AgentTimeout = 2 * time.Minute
	}
	// Open finishes what a killed kvbox left half-done, as every kvbox
	// command does first, and says so here.
	k, err := kvbox.Open(ctx, kvbox.Config{URI: c.URI, StateDir: c.StateDir, DomainType: c.DomainType, Network: n,
		Notify: func(n kvbox.Notice) {
			if n.Warning {
				slog.Warn("kvbox: " + n.Text)
			} else {
				slog.Info("kvbox: " + n.Text)
			}
		}})
	if err != nil {
		return nil, err
	}
	// A host libvirt cannot describe fails here, not at the first pod.
	if _, err := k.HostCompat(ctx); err != nil {
		k.Close()
		return nil, err
	}
	return &host{k: k, timeout: c.AgentTimeout}, nil
}

func (x *host) Close() error { return x.k.Close() }

func (x *host) Facts(ctx context.Context) (kvboxnode.HostFacts, error) {
	hc, err := x.k.HostCompat(ctx)
	if err != nil {
		return kvboxnode.HostFacts{}, err
	}
	cpus, mem, err := x.k.Capacity(ctx)
	if err != nil {
		return kvboxnode.HostFacts{}, err
	}
	return kvboxnode.HostFacts{Compat: hc, CPUs: cpus, Memory: mem}, nil
}

func (x *host) Healthy(ctx context.Context) error { return x.k.Healthy(ctx) }

// kind gives err the kvboxnode error its kind is, its text as it is.
func kind(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, snapshot.ErrIncompatible) {
		return kindError{err, kvboxnode.ErrIncompatible}
	}
	k, ok := map[base.Kind]error{base.NotFound: kvboxnode.ErrNotFound, base.Busy: kvboxnode.ErrBusy,
		base.Exists: kvboxnode.ErrExists}[base.KindOf(err)]
	if !ok {
		return err
	}
	return kindError{err, k}
}

// kindError is err, and a kvboxnode error for errors.Is.
type kindError struct{ err, kind error }

func (e kindError) Error() string   { return e.err.Error() }
func (e kindError) Unwrap() []error { return []error{e.err, e.kind} }

func box(b kvbox.Box) kvboxnode.Box {
	return kvboxnode.Box{Name: b.Name, State: string(b.State), IP: b.IP, Snapshot: b.Snapshot, Labels: b.Labels, Created: b.Created,
		CPUs: b.CPUs, Memory: b.MemoryBytes, Disk: b.DiskBytes}
}

func (x *host) Clone(ctx context.Context, r kvboxnode.CloneRequest) (kvboxnode.Box, error) {
	b, _, err := x.k.Clone(ctx, kvbox.CloneRequest{Snapshot: r.Snapshot, Name: r.Name, Hostname: r.Hostname, Labels: r.Labels,
		AgentTimeout: x.timeout})
	if err != nil {
		return kvboxnode.Box{}, kind(err)
	}
	return box(b), nil
}

func (x *host) Boxes(ctx context.Context) ([]kvboxnode.Box, error) {
	bs, err := x.k.Boxes(ctx)
	if err != nil {
		return nil, kind(err)
	}
	out := make([]kvboxnode.Box, 0, len(bs))
	for _, b := range bs {
		out = append(out, box(b))
	}
	return out, nil
}

func (x *host) Remove(ctx context.Context, name string) error {
	return kind(x.k.Remove(ctx, name, true))
}

func (x *host) Start(ctx context.Context, name string) (kvboxnode.Box, error) {
	if _, err := x.k.Start(ctx, name, x.timeout); err != nil {
		return kvboxnode.Box{}, kind(err)
	}
	b, err := x.k.Box(ctx, name)
	if err != nil {
		return kvboxnode.Box{}, kind(err)
	}
	return box(b), nil
}

func (x *host) Ping(ctx context.Context, name string) error { return kind(x.k.Ping(ctx, name)) }

func (x *host) Dial(ctx context.Context, name, target string) (net.Conn, error) {
	c, err := x.k.Dial(ctx, name, target)
	return c, kind(err)
}

func (x *host) Exec(ctx context.Context, name string, r agent.ExecRequest, stdin io.Reader, stdout, stderr io.Writer, resize <-chan agent.WinSize) (int, error) {
	code, err := x.k.Exec(ctx, name, r, stdin, stdout, stderr, resize)
	if err != nil {
		return -1, kind(err)
	}
	return code, nil
}

func (x *host) ConsoleLog(name string) (io.ReadCloser, error) {
	r, err := x.k.ConsoleLog(name)
	return r, kind(err)
}

func (x *host) Stats(ctx context.Context, name string) (kvboxnode.BoxStats, error) {
	s, err := x.k.Stats(ctx, name)
	return kvboxnode.BoxStats{At: s.At, CPUTime: s.CPUTime, Private: s.Private, Shared: s.Shared}, kind(err)
}

// snap is s in kvboxnode's words, with its owner mark; a mark that cannot
// be read is no mark of kvbox-node's (logged).
func snap(s snapshot.Snapshot) kvboxnode.Snapshot {
	out := kvboxnode.Snapshot{Name: s.Name, SizeBytes: s.SizeBytes, CPUs: s.CPUs, Memory: s.MemoryBytes, Disk: s.DiskBytes}
	o, ok, err := snapshot.OwnerOf(s)
	if err != nil {
		slog.Warn("kvbox: a snapshot's owner mark", "snapshot", s.Name, "err", err)
	}
	if ok {
		out.Owner, out.OwnerDigest = o.Owner, o.Digest
	}
	return out
}

func (x *host) Snapshots(ctx context.Context) ([]kvboxnode.Snapshot, error) {
	l, err := x.k.Snapshots(ctx)
	if err != nil {
		return nil, kind(err)
	}
	out := make([]kvboxnode.Snapshot, 0, len(l))
	for _, s := range l {
		out = append(out, snap(s.Snapshot))
	}
	return out, nil
}

func (x *host) Snapshot(ctx context.Context, name string) (kvboxnode.Snapshot, error) {
	s, err := x.k.GetSnapshot(ctx, name)
	if err != nil {
		return kvboxnode.Snapshot{}, kind(err)
	}
	return snap(s), nil
}

func (x *host) RemoveSnapshot(ctx context.Context, name string) error {
	return kind(x.k.RemoveSnapshot(ctx, name))
}

// options are the library's registry options of a pod's pull: HTTPS only
// unless the registry is one the operator named insecure, the pod's
// keychain and no other credentials (not root's docker config: without a
// keychain none are sent), the node's caps on a snapshot's size.
func options(o kvboxnode.PullOptions) kvbox.RegistryOptions {
	kc := o.Keychain
	if kc == nil {
		kc = authn.NewMultiKeychain() // resolves to anonymous
	}
	return kvbox.RegistryOptions{Insecure: o.Insecure, SecureOnly: true, Keychain: kc,
		MaxCPUs: o.MaxCPUs, MaxMemoryBytes: o.MaxMemory, MaxDiskBytes: o.MaxDisk}
}

func (x *host) Resolve(ctx context.Context, ref string, o kvboxnode.PullOptions) (string, error) {
	d, err := x.k.Resolve(ctx, ref, options(o))
	return d, kind(err)
}

// Pull pulls the artifact and marks the snapshot kvbox-node's, with the
// artifact's digest (snapshot.SetOwner); a snapshot it could not mark is
// removed again.
func (x *host) Pull(ctx context.Context, ref, name string, o kvboxnode.PullOptions) (kvboxnode.Snapshot, error) {
	res, err := x.k.Pull(ctx, ref, name, options(o))
	if err != nil {
		return kvboxnode.Snapshot{}, kind(err)
	}
	if err := snapshot.SetOwner(res.Snapshot, snapshot.Owner{Owner: snapshot.OwnerKvboxNode, Digest: res.Digest}); err != nil {
		if rerr := x.k.RemoveSnapshot(context.WithoutCancel(ctx), name); rerr != nil {
			err = fmt.Errorf("%w (and the unmarked snapshot stays: %v)", err, rerr)
		}
		return kvboxnode.Snapshot{}, err
	}
	return snap(res.Snapshot), nil
}
