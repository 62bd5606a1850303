package kvbox

import (
	"context"
	"fmt"
	"net"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/guest-agent/envd"
	"kvbox.dev/kvbox/progress"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/step"
)

// CreateRequest is a box to boot from an image.
type CreateRequest struct {
	Name string
	// Image is the base image (image.DefaultImage when empty). It must be
	// there: building one is the front's (kvbox images build).
	Image       string
	CPUs        int
	MemoryBytes int64
	DiskBytes   int64
	// Network is "" or "isolated" (kvbox's bridge, the internet through
	// NAT and nothing else), "none" (no interface) or "group:NAME" (the
	// same, and the boxes of group NAME reach each other).
	Network string
	// Expires is the box's deadline (nil: none).
	Expires *time.Time
	// Publish forwards host ports to the box while it lives; a host port
	// 0 gets the one the kernel picks, written back here.
	Publish []Port
	// Labels are kept with the box (Box.Labels), in its definition:
	// never a secret.
	Labels map[string]string
	// Egress is the box's egress policy (nil: none), in force from its
	// first packet and kept in its definition.
	Egress *egress.Policy
	// AgentTimeout bounds the wait for the box's agent (90s when 0).
	AgentTimeout time.Duration
	Progress     progress.Reporter
}

// CloneRequest is a warm clone of a snapshot.
type CloneRequest struct {
	Snapshot, Name string
	// Expires is the clone's deadline (nil: none), in its definition from
	// the start; SuspendAtExpiry makes it suspend the clone (and take
	// itself away) instead of removing it.
	Expires         *time.Time
	SuspendAtExpiry bool
	Publish         []Port
	Labels          map[string]string
	// Hostname is the guest's hostname ("": Name), given with its
	// identity and again at each start.
	Hostname string
	// NoInternet gives the clone no route out of the host (boxes of its
	// group still reach it).
	NoInternet bool
	// Egress is the clone's egress policy: nil gives it its snapshot's,
	// the zero Policy none.
	Egress *egress.Policy
	// Envd, when set, configures the envd of the clone's agent (a
	// sandbox's token, variables, ids) in its identify round trip: the
	// clone is up only once its envd serves.
	Envd *envd.Config
	// AgentTimeout bounds the wait for the agent and the identity (90s
	// when 0); HooksTimeout the after-clone hooks, all of them
	// (agent.DefaultHooksDeadline when 0).
	AgentTimeout, HooksTimeout time.Duration
	Progress                   progress.Reporter
}

// Create boots a new box from an image, waits for its agent and gives it
// its deadline, labels and published ports: the box with all of them, or nothing
// (everything made is removed). The ports are bound before the box is
// made: a taken one makes nothing.
func (h *Host) Create(ctx context.Context, req CreateRequest) (Box, step.Timings, error) {
	spec, err := h.spec(req)
	if err != nil {
		return Box{}, nil, err
	}
	if err := h.ensureEgressFor(req.Egress); err != nil {
		return Box{}, nil, err
	}
	return h.made(ctx, req.Publish, req.Expires, req.Progress, fmt.Sprintf("booting %s from image %s, waiting for its agent", req.Name, spec.Boot.Image),
		func() (domain.Box, step.Timings, error) { return h.d.CreateTimed(ctx, spec) })
}

// Clone starts a warm clone of a snapshot, checked first against this host
// (domain type, machine, QEMU, CPU), with its deadline and published
// ports: the clone with all of them, or nothing.
func (h *Host) Clone(ctx context.Context, req CloneRequest) (Box, step.Timings, error) {
	snap, err := h.cloneable(req)
	if err != nil {
		return Box{}, nil, err
	}
	if err := h.ensureEgressFor(h.cloneEgress(snap, req.Egress)); err != nil {
		return Box{}, nil, err
	}
	return h.made(ctx, req.Publish, req.Expires, req.Progress, fmt.Sprintf("cloning %s from snapshot %s", req.Name, snap.Name),
		func() (domain.Box, step.Timings, error) { return h.clone(ctx, snap, req) })
}

// made binds ports, makes the box with make while stage shows on p, and
// gives it its deadline and ports (finish). The ports are bound first: a
// taken one makes nothing.
func (h *Host) made(ctx context.Context, ports []Port, expires *time.Time, p progress.Reporter, stage string,
	make func() (domain.Box, step.Timings, error)) (Box, step.Timings, error) {
	ls, err := Listen(ports)
	if err != nil {
		return Box{}, nil, err
	}
	defer closeAll(ls)
	st := progress.Of(p).Stage(stage)
	b, tm, err := make()
	st.End()
	if err != nil {
		return Box{}, tm, err
	}
	out, err := h.finish(ctx, b, expires, ports, ls)
	return out, tm, err
}

// cloneable checks req and finds its snapshot, which this host must be
// able to restore.
func (h *Host) cloneable(req CloneRequest) (snapshot.Snapshot, error) {
	if err := base.ValidName(req.Name); err != nil {
		return snapshot.Snapshot{}, err
	}
	if _, err := labels(req.Labels); err != nil {
		return snapshot.Snapshot{}, err
	}
	if req.Hostname != "" {
		if err := base.ValidHostname(req.Hostname); err != nil {
			return snapshot.Snapshot{}, err
		}
	}
	if req.Envd != nil {
		if err := req.Envd.Validate(); err != nil {
			return snapshot.Snapshot{}, base.Errorf(base.Invalid, "%v", err)
		}
	}
	snap, err := h.snaps.Get(req.Snapshot)
	if err != nil {
		return snapshot.Snapshot{}, err
	}
	return snap, h.CheckHostFor(snap)
}

// clone is the clone itself.
func (h *Host) clone(ctx context.Context, snap snapshot.Snapshot, req CloneRequest) (domain.Box, step.Timings, error) {
	timeout := req.AgentTimeout
	if timeout <= 0 {
		timeout = 90 * time.Second
	}
	ls, err := labels(req.Labels)
	if err != nil {
		return domain.Box{}, nil, err
	}
	o := snapshot.CloneOptions{AgentTimeout: timeout, HooksDeadline: req.HooksTimeout,
		Expires: req.Expires, Labels: ls, Hostname: req.Hostname, NoInternet: req.NoInternet, Egress: req.Egress, Envd: req.Envd}
	if req.SuspendAtExpiry {
		o.OnExpiry = domain.ExpirySuspend
	}
	return snapshot.CloneWith(ctx, h.d, snap, req.Name, o)
}

// finish gives a box just made what the request asked for besides the box
// itself; a box that cannot have it all is removed.
func (h *Host) finish(ctx context.Context, b domain.Box, expires *time.Time, ports []Port, ls []*net.TCPListener) (Box, error) {
	if hasHeaders(b.Egress) {
		// Its header transforms' names are served with the host's CA.
		if err := h.trustEgressCA(ctx, b.Name); err != nil {
			return Box{}, h.undo(ctx, b.Name, fmt.Errorf("%w: box %s removed", err, b.Name))
		}
	}
	switch {
	case b.Expires != nil:
		// A clone's deadline is in its definition: its reaper starts
		// now (a kvbox killed before leaves it to the next sweep).
		if err := h.startReaper(ReapBox, b.Name, b.UUID); err != nil {
			return Box{}, h.undo(ctx, b.Name, fmt.Errorf("box %q could not get its TTL's reaper, so it is removed: %w", b.Name, err))
		}
	case expires != nil:
		nb, err := h.SetExpires(ctx, b.Name, expires)
		if err != nil {
			return Box{}, h.undo(ctx, b.Name, fmt.Errorf("box %q could not get its TTL, so it is removed: %w", b.Name, err))
		}
		b = nb.Box
	}
	if len(ports) > 0 {
		if err := h.startPublish(b, ports, ls); err != nil {
			return Box{}, h.undo(ctx, b.Name, fmt.Errorf("%w: box %s removed", err, b.Name))
		}
	}
	return Box{Box: b, Published: ports, Labels: domain.LabelMap(b.Labels)}, nil
}

// undo removes box name, which could not be made whole, and returns why
// (and why the removal failed, if it did).
func (h *Host) undo(ctx context.Context, name string, why error) error {
	if err := h.Remove(context.WithoutCancel(ctx), name, true); err != nil {
		return fmt.Errorf("%w (and removing the box failed: %v)", why, err)
	}
	return why
}
