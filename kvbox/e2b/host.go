package e2b

// The serve.Host of `kvbox serve`: the kvbox library's Host, its types and
// error kinds put in serve's words. Nothing is done here that the library
// does not do for the CLI too.

import (
	"context"
	"errors"
	"net"
	"slices"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/serve"
)

// Host is serve.Host over the library's host k.
func Host(k *kvbox.Host) serve.Host { return serveHost{k} }

// serveHost is serve.Host over the library.
type serveHost struct{ k *kvbox.Host }

// kindError is err with the serve error kind of its library kind.
type kindError struct {
	err  error
	kind error
}

func (e kindError) Error() string   { return e.err.Error() }
func (e kindError) Unwrap() []error { return []error{e.err, e.kind} }

// serveErr gives err the kind serve tells its clients apart by.
func serveErr(err error) error {
	kinds := map[base.Kind]error{base.NotFound: serve.ErrNotFound, base.Exists: serve.ErrExists,
		base.Busy: serve.ErrBusy, base.Invalid: serve.ErrInvalid}
	if k, ok := kinds[base.KindOf(err)]; ok {
		return kindError{err, k}
	}
	return err
}

func serveBox(b kvbox.Box) serve.Box {
	st := serve.Stopped
	switch {
	case b.State == kvbox.StateRunning:
		st = serve.Running
	case b.State == kvbox.StateSuspended && b.Suspended != nil:
		st = serve.Suspended
	}
	return serve.Box{Name: b.Name, UUID: b.UUID, State: st, Snapshot: b.Snapshot, Created: b.Created, Expires: b.Expires,
		CPUs: b.CPUs, MemoryBytes: b.MemoryBytes, DiskBytes: b.DiskBytes, Labels: b.Labels, NoInternet: b.NoInternet,
		SuspendAtExpiry: b.SuspendsAtExpiry()}
}

// othersOwn says snapshot name is kept by another program for itself
// (kvbox-node's cache marks its own): serve neither lists, clones nor
// removes it, whatever its API key's holder asks. A mark that cannot be
// read counts as one.
func (sh serveHost) othersOwn(ctx context.Context, name string) bool {
	owner, err := sh.k.SnapshotOwner(ctx, name)
	return owner != "" || err != nil && !errors.Is(err, base.ErrNotFound)
}

// notServes is the answer for a snapshot othersOwn: to serve's clients it
// is not there.
func notServes(name string) error {
	return kindError{base.Errorf(base.NotFound, "snapshot %q does not exist for kvbox serve (another program keeps it for itself)", name), serve.ErrNotFound}
}

func (sh serveHost) Clone(ctx context.Context, req serve.CloneRequest) (serve.Box, error) {
	if sh.othersOwn(ctx, req.Snapshot) {
		return serve.Box{}, notServes(req.Snapshot)
	}
	b, _, err := sh.k.Clone(ctx, kvbox.CloneRequest{Snapshot: req.Snapshot, Name: req.Name, Expires: req.Expires,
		SuspendAtExpiry: req.SuspendAtExpiry, Labels: req.Labels, NoInternet: req.NoInternet, Envd: req.Envd, Egress: req.Egress})
	return serveBox(b), serveErr(err)
}

func (sh serveHost) Remove(ctx context.Context, name string) error {
	return serveErr(sh.k.Remove(ctx, name, true))
}

func (sh serveHost) Suspend(ctx context.Context, name string) error {
	_, err := sh.k.Suspend(ctx, name, nil)
	return serveErr(err)
}

func (sh serveHost) Resume(ctx context.Context, name string) error {
	_, err := sh.k.Resume(ctx, name, 60*time.Second, nil)
	return serveErr(err)
}

// stopTimeout bounds a sandbox's guest's own shutdown at a filesystem-only
// pause (kvbox stop's default); bootTimeout its agent's answer after a
// cold boot, which under emulation takes a while.
const (
	stopTimeout = 30 * time.Second
	bootTimeout = 3 * time.Minute
)

func (sh serveHost) Stop(ctx context.Context, name string) error {
	return serveErr(sh.k.Stop(ctx, name, false, stopTimeout))
}

func (sh serveHost) Boot(ctx context.Context, name string) error {
	_, err := sh.k.Start(ctx, name, bootTimeout)
	return serveErr(err)
}

func (sh serveHost) SetLabels(ctx context.Context, name string, labels map[string]string) (serve.Box, error) {
	b, err := sh.k.SetLabels(ctx, name, labels)
	if err != nil {
		return serve.Box{}, serveErr(err)
	}
	return serveBox(b), nil
}

func (sh serveHost) SetSnapshotExpires(ctx context.Context, name string, at *time.Time) error {
	if sh.othersOwn(ctx, name) {
		return notServes(name)
	}
	_, err := sh.k.SetSnapshotExpires(ctx, name, at)
	return serveErr(err)
}

func (sh serveHost) SetExpires(ctx context.Context, name string, at *time.Time) (serve.Box, error) {
	b, err := sh.k.SetExpires(ctx, name, at)
	if err != nil {
		return serve.Box{}, serveErr(err)
	}
	return serveBox(b), nil
}

func (sh serveHost) Boxes(ctx context.Context) ([]serve.Box, error) {
	bs, err := sh.k.Boxes(ctx)
	return each(bs, err, serveBox)
}

func (sh serveHost) Box(ctx context.Context, name string) (serve.Box, error) {
	b, err := sh.k.Box(ctx, name)
	if err != nil {
		return serve.Box{}, serveErr(err)
	}
	return serveBox(b), nil
}

func (sh serveHost) Snapshot(ctx context.Context, box, name string, expires *time.Time) (serve.Snapshot, error) {
	res, err := sh.k.Snapshot(ctx, box, name, kvbox.SnapshotOptions{Expires: expires})
	if err != nil {
		return serve.Snapshot{}, serveErr(err)
	}
	s := res.Snapshot
	return serve.Snapshot{Name: s.Name, Box: s.Box, Created: s.Created, Expires: s.Expires}, nil
}

func (sh serveHost) Snapshots(ctx context.Context) ([]serve.Snapshot, error) {
	snaps, err := sh.k.Snapshots(ctx)
	if err == nil {
		snaps = slices.DeleteFunc(snaps, func(s kvbox.SnapshotInfo) bool { return sh.othersOwn(ctx, s.Name) })
	}
	return each(snaps, err, func(s kvbox.SnapshotInfo) serve.Snapshot {
		return serve.Snapshot{Name: s.Name, Box: s.Box, Created: s.Created, Expires: s.Expires}
	})
}

func (sh serveHost) RemoveSnapshot(ctx context.Context, name string) error {
	if sh.othersOwn(ctx, name) {
		return notServes(name)
	}
	return serveErr(sh.k.RemoveSnapshot(ctx, name))
}

func (sh serveHost) SetEgress(ctx context.Context, name string, p egress.Policy) error {
	_, err := sh.k.SetEgress(ctx, name, p)
	return serveErr(err)
}

func (sh serveHost) SetSecret(name string, value []byte) error {
	return serveErr(sh.k.SetSecret(name, value))
}

func (sh serveHost) RemoveSecret(name string) error { return serveErr(sh.k.RemoveSecret(name)) }

func (sh serveHost) Dial(ctx context.Context, name, target string) (net.Conn, error) {
	c, err := sh.k.Dial(ctx, name, target)
	return c, serveErr(err)
}

// each is a listing (or its error) in serve's words.
func each[T, U any](items []T, err error, f func(T) U) ([]U, error) {
	if err != nil {
		return nil, serveErr(err)
	}
	out := make([]U, 0, len(items))
	for _, it := range items {
		out = append(out, f(it))
	}
	return out, nil
}

var _ serve.Host = serveHost{}
