package snapshot

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/egress"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/guest-agent/envd"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/revert"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/vmstate"
	"libvirt.org/go/libvirtxml"
)

// Clone starts a warm clone of snap named name: a new domain whose RAM maps
// the snapshot's memory privately, whose disk is an overlay on the
// snapshot's disk, and whose CPU and device state is loaded from the
// snapshot's state file. The clone is re-identified through its agent
// (hostname, MAC, address, clock, entropy) while its bridge port is
// closed; only then does the port open. On any failure, agent timeout
// included, everything created is removed and the address is free again.
//
// It runs the box plan (domain.Creation.Plan) with its define step making
// the clone's domain and its start step replaced by a paused start, the
// closing of the port and the loading of the state; the port opens after
// the identity step, and the definition for the next cold boot comes last.
func Clone(ctx context.Context, h *domain.Host, snap Snapshot, name string, agentTimeout time.Duration) (domain.Box, step.Timings, error) {
	return CloneWith(ctx, h, snap, name, CloneOptions{AgentTimeout: agentTimeout})
}

// CloneOptions are the bounds of a clone's waits.
type CloneOptions struct {
	// AgentTimeout bounds the wait for the agent and the identity.
	AgentTimeout time.Duration
	// HooksDeadline bounds the after-clone hooks, all of them (0:
	// agent.DefaultHooksDeadline): a clone whose hooks have not ended by
	// then fails and is removed, as one whose hook failed.
	HooksDeadline time.Duration

	// Expires is the clone's deadline, in its metadata from its
	// definition on (the caller starts its reaper once it runs).
	Expires *time.Time
	// OnExpiry is what the deadline does (domain.Meta.OnExpiry).
	OnExpiry string
	// Labels are kept in the clone's metadata (domain.Meta.Labels).
	Labels []domain.Label
	// Hostname is the guest's hostname ("": the clone's name), kept in
	// its metadata (domain.Meta.Hostname) and given in its identify round
	// trip, so its after-clone hooks already see it.
	Hostname string
	// NoInternet gives the clone no route out of the host
	// (domain.Meta.NoInternet), from its first frame.
	NoInternet bool
	// Egress, when set, is the clone's egress policy (an empty one: none);
	// nil gives it its snapshot's (domain.Meta.Egress).
	Egress *egress.Policy
	// Envd, when set, configures the envd of the clone's agent (a
	// sandbox's access token, variables, ids) in the clone's identify
	// round trip: the clone is up only once its envd serves that sandbox.
	Envd *envd.Config
}

// CloneWith is Clone with o's bounds.
func CloneWith(ctx context.Context, h *domain.Host, snap Snapshot, name string, o CloneOptions) (domain.Box, step.Timings, error) {
	agentTimeout := o.AgentTimeout
	if err := base.ValidName(name); err != nil {
		return domain.Box{}, nil, err
	}
	srcXML, err := os.ReadFile(snap.Path(DomainXMLFile))
	if err != nil {
		return domain.Box{}, nil, fmt.Errorf("snapshot %q: %w", snap.Name, err)
	}
	if err := h.EnsureNetwork(); err != nil {
		return domain.Box{}, nil, err
	}
	// The clone's agent has its snapshot's token until identify gives it
	// one of its own.
	for _, l := range o.Labels {
		if err := domain.ValidLabel(l.Key, l.Value); err != nil {
			return domain.Box{}, nil, err
		}
	}
	if o.Hostname != "" {
		if err := base.ValidHostname(o.Hostname); err != nil {
			return domain.Box{}, nil, err
		}
	}
	cl := &cloning{snap: snap, srcXML: string(srcXML), hooksDeadline: o.HooksDeadline, opts: o,
		c: &domain.Creation{Host: h, Name: name, AgentTimeout: agentTimeout, NewToken: true, BootID: snap.GuestBootID}}
	if o.Envd != nil {
		if err := o.Envd.Validate(); err != nil {
			return domain.Box{}, nil, base.Errorf(base.Invalid, "%v", err)
		}
		cl.c.Extra = []agent.Call{agent.EnvdInitCall(*o.Envd)}
	}
	b, tm, err := cl.c.Run(ctx, cl.plan())
	var re *agent.RemoteError
	if o.Envd != nil && errors.As(err, &re) && strings.Contains(re.Message, "unknown method") {
		err = base.Errorf(base.Invalid, "snapshot %q: its agent has no envd (the feature %q: it was made from an image with an older kvbox-agent; build the image and the snapshot again with this kvbox): %v",
			snap.Name, agent.FeatureEnvd, err)
	}
	return b, tm, err
}

// cloning is one clone being made.
type cloning struct {
	c      *domain.Creation
	snap   Snapshot
	srcXML string              // the snapshot's domain XML
	spec   vmstate.RestoreSpec // what the clone's XML is made from
	net    network.Config      // the network it is on: the main one or its group's

	hooksDeadline time.Duration // CloneOptions.HooksDeadline
	opts          CloneOptions
}

func (cl *cloning) plan() step.Plan {
	c := cl.c
	return c.Plan(cl.define).
		Replace("start",
			step.Step{Name: "start", Do: c.StartPaused, Undo: c.Destroy},
			step.Step{Name: "close-port", Do: cl.closePort},
			step.Step{Name: "load", Do: cl.load},
			step.Step{Name: "resume", Do: cl.resume},
		).
		// The agent runs already: its first contact and the identity go
		// in one round trip.
		Replace("identify").
		Replace("agent", step.Step{Name: "identify", Do: c.AgentIdentify}).
		After("identify",
			step.Step{Name: "after-clone-hooks", Do: cl.hooks},
			step.Step{Name: "open-port", Do: cl.openPort},
			step.Step{Name: "persist", Do: cl.persist},
		)
}

// define picks a free address, makes the folder and the overlay on the
// snapshot's disk, and defines the domain, which then holds the address in
// its metadata. It runs under the host lock.
func (cl *cloning) define(ctx context.Context, c *domain.Creation, r *revert.Reverter) (err error) {
	h, snap := c.Host, cl.snap
	// The snapshot may have been deleted since it was read; under the lock
	// snapshots rm cannot delete it until this clone is defined.
	if _, err := os.Stat(snap.Path(MetaFile)); err != nil {
		return base.Errorf(base.NotFound, "snapshot %q is gone", snap.Name)
	}
	// A clone is in its snapshot's group, if the snapshot's box was in one.
	src, _, err := domain.MetaOfXML(cl.srcXML)
	if err != nil {
		return err
	}
	if cl.net, err = h.GroupNetwork(src.Group); err != nil {
		return err
	}
	if c.Res, err = h.Reserve(c.Name, cl.net, r); err != nil {
		return err
	}
	dir := c.Res.Dir
	disk := filepath.Join(dir, domain.DiskFile) // an overlay on the snapshot's disk
	if err := overlay.Create(ctx, disk, snap.Path(DiskFile), "qcow2"); err != nil {
		return err
	}
	// QEMU writes the clone's own disk; libvirt chowns nothing (DACLabel).
	if err := h.ChownForQEMU(disk); err != nil {
		return err
	}
	if err := copyAgentToken(snap.Dir, dir); err != nil {
		return err
	}
	dac, err := h.DACLabel()
	if err != nil {
		return err
	}
	meta := domain.Meta{
		Image: snap.Image, Snapshot: snap.Name, IP: c.Res.IP.String(), Prefix: cl.net.Subnet.Bits(),
		Gateway: cl.net.Gateway().String(), MAC: network.NewMAC(), Bridge: cl.net.Bridge, Group: src.Group, Dir: dir,
		DiskBytes: snap.DiskBytes, Transport: domain.Transport(), Created: time.Now().UTC().Truncate(time.Second),
		Labels: cl.opts.Labels, NoInternet: cl.opts.NoInternet, OnExpiry: cl.opts.OnExpiry, Hostname: cl.opts.Hostname,
	}
	if at := cl.opts.Expires; at != nil {
		t := at.UTC().Truncate(time.Second)
		meta.Expires = &t
	}
	// A clone has its snapshot's egress policy unless it was given one.
	switch p := cl.opts.Egress; {
	case p != nil && !p.IsZero():
		meta.Egress = p
	case p == nil && src.Egress != nil && !src.Egress.IsZero():
		if err := src.Egress.Validate(); err != nil {
			return fmt.Errorf("snapshot %q: %w", snap.Name, err)
		}
		meta.Egress = src.Egress
	}
	if !hasInterface(cl.srcXML) {
		meta.Egress = nil // a clone of a box without network has none either
		meta.IP, meta.Prefix, meta.Gateway, meta.MAC, meta.Bridge, meta.Group, meta.NoInternet = "", 0, "", "", "", "", false
	}
	cl.spec = vmstate.RestoreSpec{
		Name: c.Name, Meta: meta, Disk: disk,
		MemPath: snap.Path(StateFile), MemOffset: snap.Memory.Offset, MemBytes: snap.MemoryBytes,
		DACLabel: dac,
	}
	xml, err := vmstate.RestoreXML(cl.srcXML, cl.spec)
	if err != nil {
		return err
	}
	if err := h.EnsureEmulator(xml); err != nil {
		return err
	}
	if c.Dom, err = h.Conn().DomainDefineXML(xml); err != nil {
		return fmt.Errorf("define clone %q: %s", c.Name, domain.LibvirtMessage(err))
	}
	r.Add(func() { domain.Undefine(c.Dom) })
	return c.Reread()
}

// copyAgentToken copies the token of the agent in a snapshot's memory from
// its folder to a clone's, root's only. Every snapshot has one: the clone's
// first contact presents it.
func copyAgentToken(from, to string) error {
	tok, err := domain.ReadAgentToken(from)
	if err != nil {
		return err
	}
	if tok == nil {
		return fmt.Errorf("the snapshot in %s has no agent token (%s), which its clones' first contact presents: take the snapshot again", from, domain.AgentTokenFile)
	}
	return overlay.WriteFileAtomic(filepath.Join(to, domain.AgentTokenFile), tok, 0o600)
}

// closePort: not one frame of the clone may reach the bridge before it is
// re-identified: the restored guest still believes it is the source
// (gratuitous ARP with the source's MAC and IP), and QEMU announces when
// the incoming migration ends.
func (cl *cloning) closePort(context.Context) error {
	if cl.spec.Meta.Bridge == "" {
		return nil // a box without network: no port
	}
	if cl.c.Box.Tap == "" {
		return fmt.Errorf("clone %q has no network port to close", cl.c.Name)
	}
	return network.ClosePort(cl.c.Box.Tap)
}

func (cl *cloning) openPort(context.Context) error {
	if cl.spec.Meta.Bridge == "" {
		return nil
	}
	return cl.net.OpenPort(cl.c.Box.Tap)
}

func (cl *cloning) load(ctx context.Context) error {
	if err := vmstate.Load(ctx, cl.c.Host.QMP(cl.c.Dom, cl.c.Name), cl.c.Name, cl.snap.Path(StateFile)); err != nil {
		return fmt.Errorf("load snapshot %q into clone %q: %w", cl.snap.Name, cl.c.Name, err)
	}
	return nil
}

func (cl *cloning) resume(context.Context) error {
	if err := cl.c.Dom.Resume(); err != nil {
		return fmt.Errorf("resume clone %q: %s", cl.c.Name, domain.LibvirtMessage(err))
	}
	cl.c.Box.State = domain.StateRunning
	return nil
}

// persist: the running clone was started from a definition that maps the
// snapshot and waits for -incoming; its next cold boot must not.
func (cl *cloning) persist(context.Context) error {
	c := cl.c
	spec := cl.spec
	spec.UUID, spec.Boot = c.Box.UUID, true
	boot, err := vmstate.RestoreXML(cl.srcXML, spec)
	if err != nil {
		return err
	}
	if err := c.Host.Define(boot); err != nil {
		return fmt.Errorf("define clone %q for its next boot: %w", c.Name, err)
	}
	return nil
}

// hooks runs the box's after-clone hooks (/etc/kvbox/after-clone.d): after
// re-identification, before the port opens; a failing one, or hooks that
// outlive the host's deadline, fail the clone, which the plan then undoes.
func (cl *cloning) hooks(ctx context.Context) error {
	if _, err := cl.c.Agent.RunAfterCloneHooks(ctx, cl.hooksDeadline); err != nil {
		return fmt.Errorf("clone %q: %w", cl.c.Name, err)
	}
	return nil
}

// hasInterface reports whether a domain XML has a network interface (a box
// made with --network none has none).
func hasInterface(domXML string) bool {
	var d libvirtxml.Domain
	return d.Unmarshal(domXML) == nil && d.Devices != nil && len(d.Devices.Interfaces) > 0
}
