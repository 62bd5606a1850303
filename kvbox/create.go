package kvbox

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/guest-agent/envd"
	"kvbox.dev/kvbox/image"
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
	ls, err := Listen(req.Publish)
	if err != nil {
		return Box{}, nil, err
	}
	defer closeAll(ls)
	st := progress.Of(req.Progress).Stage(fmt.Sprintf("booting %s from image %s, waiting for its agent", req.Name, spec.Boot.Image))
	b, tm, err := h.d.CreateTimed(ctx, spec)
	st.End()
	if err != nil {
		return Box{}, tm, err
	}
	out, err := h.finish(ctx, b, req.Expires, req.Publish, ls)
	return out, tm, err
}

// spec checks req and finds its image: nothing is made when req is wrong.
func (h *Host) spec(req CreateRequest) (domain.Spec, error) {
	group, noNet, err := parseNetwork(req.Network)
	if err != nil {
		return domain.Spec{}, err
	}
	ls, err := labels(req.Labels)
	if err != nil {
		return domain.Spec{}, err
	}
	if err := base.ValidName(req.Name); err != nil {
		return domain.Spec{}, err
	}
	im, err := h.image(req.Image)
	if err != nil {
		return domain.Spec{}, err
	}
	timeout := req.AgentTimeout
	if timeout <= 0 {
		timeout = 90 * time.Second
	}
	return domain.Spec{Name: req.Name, CPUs: req.CPUs, MemoryBytes: req.MemoryBytes, DiskBytes: req.DiskBytes,
		AgentTimeout: timeout, NoNetwork: noNet, Group: group, Labels: ls,
		Boot: domain.Boot{Image: im.Name, Disk: im.Disk, DiskFormat: im.Format, VirtualSize: im.VirtualSize,
			Kernel: im.Kernel, Initrd: im.Initrd, Cmdline: im.Cmdline}}, nil
}

// image is the named image (the default one when name is empty). One
// without an agent is refused: its boxes could never be reached.
func (h *Host) image(name string) (image.Image, error) {
	if name == "" {
		name = image.DefaultImage
	}
	im, err := h.images.Get(name)
	if err != nil {
		return image.Image{}, err
	}
	if im.Agent == "no" {
		return image.Image{}, base.Errorf(base.Invalid, "image %q has no kvbox-agent; install bin/kvbox-agent in it as a service and import it again with --agent yes", im.Name)
	}
	return im, nil
}

// parseNetwork reads a request's network: the group it names, or none.
func parseNetwork(n string) (group string, none bool, err error) {
	switch {
	case n == "", n == "isolated":
		return "", false, nil
	case n == "none":
		return "", true, nil
	case strings.HasPrefix(n, "group:"):
		group = strings.TrimPrefix(n, "group:")
		if err := domain.ValidGroup(group); err != nil {
			return "", false, fmt.Errorf("--network %q: %w", n, err)
		}
		return group, false, nil
	}
	return "", false, base.Errorf(base.Invalid, "--network %q: give isolated (the default), group:NAME or none", n)
}

// Clone starts a warm clone of a snapshot, checked first against this host
// (domain type, machine, QEMU, CPU), with its deadline and published
// ports: the clone with all of them, or nothing.
func (h *Host) Clone(ctx context.Context, req CloneRequest) (Box, step.Timings, error) {
	snap, err := h.cloneable(req)
	if err != nil {
		return Box{}, nil, err
	}
	ls, err := Listen(req.Publish)
	if err != nil {
		return Box{}, nil, err
	}
	defer closeAll(ls)
	st := progress.Of(req.Progress).Stage(fmt.Sprintf("cloning %s from snapshot %s", req.Name, snap.Name))
	b, tm, err := h.clone(ctx, snap, req)
	st.End()
	if err != nil {
		return Box{}, tm, err
	}
	out, err := h.finish(ctx, b, req.Expires, req.Publish, ls)
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
		Expires: req.Expires, Labels: ls, Hostname: req.Hostname, NoInternet: req.NoInternet, Envd: req.Envd}
	if req.SuspendAtExpiry {
		o.OnExpiry = domain.ExpirySuspend
	}
	return snapshot.CloneWith(ctx, h.d, snap, req.Name, o)
}

// finish gives a box just made what the request asked for besides the box
// itself; a box that cannot have it all is removed.
func (h *Host) finish(ctx context.Context, b domain.Box, expires *time.Time, ports []Port, ls []*net.TCPListener) (Box, error) {
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
