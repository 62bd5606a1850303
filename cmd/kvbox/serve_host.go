package main

// The serve.Host of `kvbox serve`: over the kvbox library for the removal
// of boxes and snapshots and their deadlines, over today's packages
// (domain, snapshot) for the rest until the library has it.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sync"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/serve"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/suspend"
)

// serveHost is serve.Host over a's host.
type serveHost struct {
	a *app
	k *kvbox.Host
	h *domain.Host

	mu      sync.Mutex
	fwd     map[string]*agent.Forwarder // a running box's stream carrier
	dialing map[string]*sync.Mutex      // one agent connection made at a time per box
	checked map[string]bool             // snapshots this host can run, by name and creation
}

func newServeHost(a *app, k *kvbox.Host) *serveHost {
	return &serveHost{a: a, k: k, h: k.Domain(), fwd: map[string]*agent.Forwarder{}, dialing: map[string]*sync.Mutex{}, checked: map[string]bool{}}
}

// kindError is err with the serve error kind of its domain sentinel.
type kindError struct {
	err  error
	kind error
}

func (e kindError) Error() string   { return e.err.Error() }
func (e kindError) Unwrap() []error { return []error{e.err, e.kind} }

// serveErr gives err the kind serve tells its clients apart by.
func serveErr(err error) error {
	if err == nil {
		return nil
	}
	for _, k := range []struct{ d, s error }{
		{base.ErrNotFound, serve.ErrNotFound}, {base.ErrExists, serve.ErrExists},
		{base.ErrBusy, serve.ErrBusy}, {base.ErrInvalid, serve.ErrInvalid},
	} {
		if errors.Is(err, k.d) {
			return kindError{err, k.s}
		}
	}
	return err
}

// ours says a box is of this state dir (domain.Host.AllBoxes lists every
// kvbox box on the libvirt host; a name looked up may be another's).
func (sh *serveHost) ours(b domain.Box) bool { return filepath.Dir(b.Dir) == sh.h.Layout().Boxes() }

func serveBox(b domain.Box) serve.Box {
	st := serve.Stopped
	switch {
	case b.State == domain.StateRunning:
		st = serve.Running
	case b.State == domain.StateSuspended && b.Suspended != nil:
		st = serve.Suspended
	}
	return serve.Box{Name: b.Name, UUID: b.UUID, State: st, Snapshot: b.Snapshot, Created: b.Created, Expires: b.Expires,
		CPUs: b.CPUs, MemoryBytes: b.MemoryBytes, DiskBytes: b.DiskBytes, Labels: domain.LabelMap(b.Labels), NoInternet: b.NoInternet,
		SuspendAtExpiry: b.OnExpiry == domain.ExpirySuspend}
}

func (sh *serveHost) Clone(ctx context.Context, req serve.CloneRequest) (serve.Box, error) {
	snap, err := sh.a.snapshots().Get(req.Snapshot)
	if err != nil {
		return serve.Box{}, serveErr(err)
	}
	key := snap.Name + "@" + snap.Created.UTC().Format(time.RFC3339Nano)
	sh.mu.Lock()
	ok := sh.checked[key]
	sh.mu.Unlock()
	if !ok {
		if err := sh.k.CheckHostFor(snap); err != nil {
			return serve.Box{}, serveErr(err)
		}
		sh.mu.Lock()
		sh.checked[key] = true
		sh.mu.Unlock()
	}
	opts := snapshot.CloneOptions{
		AgentTimeout: 90 * time.Second, HooksDeadline: agent.DefaultHooksDeadline,
		Expires: req.Expires, Labels: domain.Labels(req.Labels), NoInternet: req.NoInternet, Envd: req.Envd,
	}
	if req.SuspendAtExpiry {
		opts.OnExpiry = domain.ExpirySuspend
	}
	b, _, err := snapshot.CloneWith(ctx, sh.h, snap, req.Name, opts)
	if err != nil {
		return serve.Box{}, serveErr(err)
	}
	if b.Expires != nil {
		// Its deadline is in its metadata already; without a reaper it
		// would only go at the next sweep.
		if _, err := sh.k.SetExpires(ctx, b.Name, b.Expires); err != nil {
			sh.k.Remove(context.WithoutCancel(ctx), b.Name, true)
			return serve.Box{}, fmt.Errorf("box %q could not get its TTL's reaper, so it is removed: %w", b.Name, err)
		}
	}
	// The agent connection its streams will go through is made now,
	// while the answer goes back: the sandbox's first command (which
	// waits for it if it is not done) does not pay for it.
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		sh.forwarder(ctx, b.Name)
	}()
	return serveBox(b), nil
}

func (sh *serveHost) Remove(ctx context.Context, name string) error {
	sh.closeStreams(name)
	return serveErr(sh.k.Remove(ctx, name, true))
}

func (sh *serveHost) Suspend(ctx context.Context, name string) error {
	sh.closeStreams(name)
	_, err := suspend.Suspend(ctx, sh.h, name)
	return serveErr(err)
}

func (sh *serveHost) Resume(ctx context.Context, name string) error {
	_, err := suspend.Resume(ctx, sh.h, name, 60*time.Second)
	return serveErr(err)
}

func (sh *serveHost) SetExpires(ctx context.Context, name string, at *time.Time) (serve.Box, error) {
	b, err := sh.k.SetExpires(ctx, name, at)
	if err != nil {
		return serve.Box{}, serveErr(err)
	}
	return serveBox(b), nil
}

func (sh *serveHost) Boxes(ctx context.Context) ([]serve.Box, error) {
	bs, err := sh.h.Boxes()
	if err != nil {
		return nil, serveErr(err)
	}
	var out []serve.Box
	for _, b := range bs {
		if sh.ours(b) {
			out = append(out, serveBox(b))
		}
	}
	return out, nil
}

func (sh *serveHost) Box(ctx context.Context, name string) (serve.Box, error) {
	b, err := sh.h.Get(name)
	if err != nil {
		return serve.Box{}, serveErr(err)
	}
	if !sh.ours(b) {
		return serve.Box{}, fmt.Errorf("box %q is another state dir's: %w", name, serve.ErrNotFound)
	}
	return serveBox(b), nil
}

func (sh *serveHost) Snapshot(ctx context.Context, box, name string, expires *time.Time) (serve.Snapshot, error) {
	res, err := snapshot.CreateOf(ctx, sh.h, sh.a.snapshots(), box, name, snapshot.Phases{})
	if err != nil {
		return serve.Snapshot{}, serveErr(err)
	}
	s := res.Snapshot
	if expires != nil {
		if s, err = sh.k.SetSnapshotExpires(ctx, name, expires); err != nil {
			return serve.Snapshot{}, fmt.Errorf("snapshot %s is saved but got no TTL: %w", name, err)
		}
	}
	return serve.Snapshot{Name: s.Name, Box: s.Box, Created: s.Created, Expires: s.Expires}, nil
}

func (sh *serveHost) Snapshots(ctx context.Context) ([]serve.Snapshot, error) {
	snaps, err := sh.a.snapshots().List()
	if err != nil {
		return nil, serveErr(err)
	}
	out := make([]serve.Snapshot, 0, len(snaps))
	for _, s := range snaps {
		out = append(out, serve.Snapshot{Name: s.Name, Box: s.Box, Created: s.Created, Expires: s.Expires})
	}
	return out, nil
}

func (sh *serveHost) RemoveSnapshot(ctx context.Context, name string) error {
	return serveErr(sh.k.RemoveSnapshot(ctx, name))
}

// Dial joins one end of a socket pair (a UnixConn, which half-closes as
// TCP does) to a stream to target through the box's agent, and returns
// the other.
func (sh *serveHost) Dial(ctx context.Context, name, target string) (net.Conn, error) {
	for try := 0; ; try++ {
		f, err := sh.forwarder(ctx, name)
		if err != nil {
			return nil, err
		}
		local, remote, err := agent.SocketPair()
		if err != nil {
			return nil, err
		}
		if _, err := f.Connect(ctx, target, remote); err != nil {
			local.Close()
			remote.Close()
			select {
			case <-f.Done():
				// The box's agent connection ended (its QEMU stopped,
				// or it restarted): a new one, once.
				sh.forget(name, f)
				if try == 0 {
					continue
				}
			default:
			}
			return nil, err
		}
		return local, nil
	}
}

// forwarder is the box's stream carrier: one agent connection (a serial
// port of the box's four) shared by all its streams while it lasts.
func (sh *serveHost) forwarder(ctx context.Context, name string) (*agent.Forwarder, error) {
	sh.mu.Lock()
	l := sh.dialing[name]
	if l == nil {
		l = &sync.Mutex{}
		sh.dialing[name] = l
	}
	sh.mu.Unlock()
	l.Lock()
	defer l.Unlock()
	sh.mu.Lock()
	f := sh.fwd[name]
	sh.mu.Unlock()
	if f != nil {
		select {
		case <-f.Done():
			sh.forget(name, f)
		default:
			return f, nil
		}
	}
	b, err := sh.h.Get(name)
	if err != nil {
		return nil, serveErr(err)
	}
	c, err := sh.a.dial(ctx, sh.h, b)
	if err != nil {
		return nil, serveErr(err)
	}
	f, err = c.Forward(ctx)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("box %q: %w", name, err)
	}
	f.DialDeadline = sh.a.dialTimeout
	// A snapshot of the box (createSnapshot, fork) gives its agent a new
	// token, which ends this connection's rights: present the new one.
	f.Tokens = func() [][]byte { return domain.AgentTokens(b.Dir) }
	sh.mu.Lock()
	sh.fwd[name] = f
	sh.mu.Unlock()
	return f, nil
}

// forget drops f as name's carrier (if it still is) and closes it.
func (sh *serveHost) forget(name string, f *agent.Forwarder) {
	sh.mu.Lock()
	if sh.fwd[name] == f {
		delete(sh.fwd, name)
	}
	sh.mu.Unlock()
	f.Close()
}

// closeStreams ends the box's agent connection (before its QEMU goes).
func (sh *serveHost) closeStreams(name string) {
	sh.mu.Lock()
	f := sh.fwd[name]
	delete(sh.fwd, name)
	sh.mu.Unlock()
	if f != nil {
		f.Close()
	}
}

// close ends every box's agent connection.
func (sh *serveHost) close() {
	sh.mu.Lock()
	fs := sh.fwd
	sh.fwd = map[string]*agent.Forwarder{}
	sh.mu.Unlock()
	for _, f := range fs {
		f.Close()
	}
}
