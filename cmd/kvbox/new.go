package main

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/egress"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/kvbox"
)

type newOptions struct {
	name    string
	from    string
	image   string
	cpus    int
	memory  string
	disk    string
	timeout time.Duration
	// hooksTimeout bounds a clone's after-clone hooks, all of them.
	hooksTimeout time.Duration
	verbose      bool
	count        int
	asJSON       bool
	publish      []string

	network string
	egress  egressFlags
	// policy is what the egress flags give (nil: none given).
	policy *egress.Policy
	ttl    string
	// expires is the deadline --ttl gives, from the command's start.
	expires *time.Time
}

func (a *app) newCmdNew() *cobra.Command {
	o := &newOptions{}
	c := &cobra.Command{
		Use:   "new NAME",
		Short: "Start a new box from an image (or a warm clone from a snapshot)",
		Long: `Start a new box from an image, or a warm clone from a snapshot (--from).

With --count N, NAME is a prefix: boxes NAME-1 .. NAME-N are started in
parallel. Every name must be valid and free, or none is started. Each box
has its own outcome: kvbox lists every box with its address or its error
(--json: a list), removes whatever a failed one left behind, and exits
non-zero if any failed; the boxes that started keep running.`,
		Example: `  kvbox new dev
  kvbox new --image tiny --cpus 1 --memory 512M --disk 1G t1
  kvbox new --from warm agent-1
  kvbox new --from warm --count 5 agent      # agent-1 .. agent-5`,
		Args: exactArgs(1, "one box name (with --count: a name prefix)"),
		RunE: func(c *cobra.Command, args []string) error {
			o.name = args[0]
			return a.runNew(c, o)
		},
	}
	f := c.Flags()
	f.StringVar(&o.from, "from", "", "start a warm clone of this snapshot (kvbox snapshots ls) instead of booting an image")
	f.StringVar(&o.image, "image", "debian", "base image (kvbox images ls)")
	f.IntVar(&o.cpus, "cpus", 2, "vCPUs")
	f.StringVar(&o.memory, "memory", "4G", "RAM, like 512M or 4G")
	f.StringVar(&o.disk, "disk", "8G", "disk size, like 8G")
	f.DurationVar(&o.timeout, "timeout", 90*time.Second, "how long to wait for the guest agent")
	f.DurationVar(&o.hooksTimeout, "hooks-timeout", agent.DefaultHooksDeadline, "with --from: how long the clone's after-clone hooks may run, all of them (the guest gives each 30s); past it the clone fails and is removed")
	f.BoolVarP(&o.verbose, "verbose", "v", false, "print where the time went, step by step")
	f.IntVar(&o.count, "count", 0, "start N boxes NAME-1 .. NAME-N in parallel")
	f.BoolVar(&o.asJSON, "json", false, "print a JSON array with one element per box (name, ip, mac, or error)")
	f.StringArrayVarP(&o.publish, "publish", "p", nil, "forward [ADDR:]HOSTPORT:GUESTPORT to the box while it lives (127.0.0.1 unless ADDR is given; repeatable)")
	f.StringVar(&o.network, "network", "isolated", "isolated: on kvbox's bridge, the internet through NAT and nothing else; group:NAME: the same, and the boxes of group NAME reach each other; none: no network interface at all (exec still works)")
	o.egress.add(f)
	f.StringVar(&o.ttl, "ttl", "", "remove the box(es) this long after the start (20s, 30m, 2h, 3d), whatever happens meanwhile (kvbox ttl changes it)")
	return c
}

func (a *app) runNew(c *cobra.Command, o *newOptions) error {
	var err error
	if o.expires, err = newExpiry(c.Flags().Changed("ttl"), o.ttl, "box"); err != nil {
		return err
	}
	if o.hooksTimeout <= 0 {
		return usage("--hooks-timeout %s: give a positive duration", o.hooksTimeout)
	}
	many := c.Flags().Changed("count") || o.asJSON
	if many && len(o.publish) > 0 {
		return usage("--publish starts one box's forwards: it does not go with --count or --json")
	}
	names := []string{o.name}
	if c.Flags().Changed("count") {
		if names, err = kvbox.Names(o.name, o.count); err != nil {
			return err
		}
	} else if err := base.ValidName(o.name); err != nil {
		return err
	}
	if err := o.checkNetwork(c); err != nil {
		return err
	}
	if o.policy, err = o.egress.policy(c); err != nil {
		return err
	}
	ports, err := kvbox.ParsePorts(o.publish)
	if err != nil {
		return err
	}
	if o.from != "" {
		// Size flags do not apply: a clone has its snapshot's vCPUs, RAM
		// and disk.
		if err := o.noSizeFlags(c); err != nil {
			return err
		}
	}
	switch {
	case many:
		return a.runNewMany(c, o, names)
	case o.from != "":
		return a.runNewFrom(c, o, ports)
	}
	return a.runNewImage(c, o, ports)
}

// runNewImage boots a box from an image (the default one is built first
// if it is missing).
func (a *app) runNewImage(c *cobra.Command, o *newOptions, ports []kvbox.Port) error {
	mem, disk, err := o.sizes()
	if err != nil {
		return err
	}
	k, err := a.lib()
	if err != nil {
		return err
	}
	if err := a.ensureImage(c, o.image); err != nil {
		return err
	}
	start := time.Now()
	b, tm, err := k.Create(c.Context(), kvbox.CreateRequest{Name: o.name, Image: o.image, CPUs: o.cpus, MemoryBytes: mem, DiskBytes: disk,
		Network: o.network, Expires: o.expires, Publish: ports, Egress: o.policy, AgentTimeout: o.timeout, Progress: a.reporter()})
	if err != nil {
		return err
	}
	fmt.Fprintf(a.io.Out, "✓ box %s is running at %s from %s: %d vCPU, %s RAM, %s disk (%.1fs)%s\n",
		b.Name, b.IP, b.From(), b.CPUs, base.FormatSize(b.MemoryBytes), base.FormatSize(b.DiskBytes), time.Since(start).Seconds(), ttlNote(b.Box))
	a.printPublished(b)
	fmt.Fprintf(a.io.Out, "connect with: kvbox connect %s\n", b.Name)
	if o.verbose {
		fmt.Fprintf(a.io.Err, "timing: %s\n", tm)
	}
	return nil
}

// ensureImage builds the default image on first use, once; any other
// image must be there (Create says so if it is not).
func (a *app) ensureImage(c *cobra.Command, name string) error {
	if name != image.DefaultImage {
		return nil
	}
	if _, err := a.images().Get(name); !errors.Is(err, base.ErrNotFound) {
		return nil
	}
	fmt.Fprintf(a.io.Err, "image %s is missing: building it first (kvbox images build %s)\n", name, name)
	_, err := image.EnsureDebian(c.Context(), a.images(), image.DebianOptions{Progress: a.reporter()})
	return err
}

// printPublished says which host ports forward to box b.
func (a *app) printPublished(b kvbox.Box) {
	for _, p := range b.Published {
		fmt.Fprintf(a.io.Out, "✓ published %s -> %s:%d (until the box stops or is removed)\n", p.ListenAddr(), b.Name, p.GuestPort)
	}
}

// runNewFrom starts a warm clone of a snapshot.
func (a *app) runNewFrom(c *cobra.Command, o *newOptions, ports []kvbox.Port) error {
	start := time.Now()
	k, err := a.lib()
	if err != nil {
		return err
	}
	b, tm, err := k.Clone(c.Context(), kvbox.CloneRequest{Snapshot: o.from, Name: o.name, Expires: o.expires, Publish: ports, Egress: o.policy,
		AgentTimeout: o.timeout, HooksTimeout: o.hooksTimeout})
	if err != nil {
		return err
	}
	fmt.Fprintf(a.io.Out, "✓ box %s is running at %s from snapshot %s: %d vCPU, %s RAM, %s disk (%.2fs)%s\n",
		b.Name, b.IP, o.from, b.CPUs, base.FormatSize(b.MemoryBytes), base.FormatSize(b.DiskBytes), time.Since(start).Seconds(), ttlNote(b.Box))
	a.printPublished(b)
	fmt.Fprintf(a.io.Out, "connect with: kvbox connect %s (already up: everything that ran in the snapshot is running)\n", b.Name)
	if o.verbose {
		fmt.Fprintf(a.io.Err, "timing: %s\n", tm)
	}
	return nil
}

// noSizeFlags refuses the flags of an image's box with --from.
func (o *newOptions) noSizeFlags(c *cobra.Command) error {
	for _, f := range []string{"image", "cpus", "memory", "disk"} {
		if c.Flags().Changed(f) {
			return usage("--%s does not apply to --from: a clone has its snapshot's image, vCPUs, RAM and disk", f)
		}
	}
	return nil
}

// group is the box group --network names, if any.
func (o *newOptions) group() string {
	if g, ok := strings.CutPrefix(o.network, "group:"); ok {
		return g
	}
	return ""
}

// checkNetwork refuses a --network kvbox does not know, and --network with
// --from: a clone has its snapshot's devices (the migration stream holds
// them), a network interface or none.
func (o *newOptions) checkNetwork(c *cobra.Command) error {
	switch {
	case o.network == "isolated", o.network == "none":
	case strings.HasPrefix(o.network, "group:"):
		if err := domain.ValidGroup(o.group()); err != nil {
			return fmt.Errorf("--network %q: %w", o.network, err)
		}
	default:
		return base.Errorf(base.Invalid, "--network %q: give isolated (the default), group:NAME or none", o.network)
	}
	if o.from != "" && c.Flags().Changed("network") {
		return base.Errorf(base.Invalid, "--network with --from: a clone keeps its snapshot's network (with it or without it)")
	}
	return nil
}
