package domain

import (
	"context"
	"fmt"
	"time"

	"libvirt.org/go/libvirt"

	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/revert"
	"kvbox.dev/kvbox/step"
)

// Creation is a box being made: the host, the box's name, and what the steps
// of its plan find out and hand on to the next.
type Creation struct {
	Host *Host
	Name string
	// AgentTimeout bounds the wait for the agent and the re-identification.
	AgentTimeout time.Duration

	Dom   *libvirt.Domain // the box's domain, from define on
	Box   Box             // the box as defined, re-read once QEMU runs
	Res   Reservation     // its address and folder, until Done
	Agent *agent.Client   // open from the agent step on

	// NewToken gives the box an agent token of its own at identify (a
	// clone's agent has its snapshot's).
	NewToken bool
	// BootID, when set, is the guest boot the agent must answer from (a
	// clone: its snapshot's): another one means the guest booted again
	// after its memory was restored, and the box is not what was asked.
	BootID string
	// Extra are agent calls that go with the identity, in its round trip
	// (a sandbox's envd configuration: agent.EnvdInitCall); one that fails
	// fails the creation.
	Extra []agent.Call

	borrowed bool             // Dom is the caller's to free
	undefine *revert.Reverter // what define made
	actx     context.Context  // bounded by AgentTimeout
	cancel   context.CancelFunc
}

// DefineFunc defines the box's domain under the host lock: it reserves the
// name and an address (Host.Reserve), makes the disk, defines the domain and
// sets c.Dom, c.Box and c.Res, adding the undo of each part to r.
type DefineFunc func(ctx context.Context, c *Creation, r *revert.Reverter) error

// Plan is the plan of a box: define its domain, start QEMU, wait for the
// agent, and give the guest its identity. A clone is this plan with its
// define and start steps replaced and its port steps added.
func (c *Creation) Plan(define DefineFunc) step.Plan {
	return step.Plan{
		{Name: "define", Do: func(ctx context.Context) error { return c.define(ctx, define) }, Undo: c.undoDefine},
		{Name: "start", Do: c.start, Undo: c.Destroy},
		{Name: "agent", Do: c.waitAgent},
		{Name: "identify", Do: c.identify},
	}
}

// Run runs the plan. On success the box is complete (its creation marker
// goes) and is returned as libvirt now reports it; on failure everything the
// steps made is removed.
func (c *Creation) Run(ctx context.Context, p step.Plan) (Box, step.Timings, error) {
	if c.AgentTimeout <= 0 {
		c.AgentTimeout = 60 * time.Second
	}
	defer func() {
		if c.Agent != nil {
			c.Agent.Close()
		}
		if c.cancel != nil {
			c.cancel()
		}
		if c.Dom != nil && !c.borrowed {
			c.Dom.Free() // after the undo steps, which use it
		}
	}()
	ts, err := p.Run(ctx)
	if err != nil {
		return Box{}, ts, err
	}
	if c.Res.marker != nil {
		c.Res.Done()
	}
	b, err := c.Host.Get(c.Name)
	return b, ts, err
}

func (c *Creation) define(ctx context.Context, define DefineFunc) error {
	unlock, err := c.Host.Lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	r := revert.New()
	defer r.Fail()
	if err := define(ctx, c, r); err != nil {
		return err
	}
	// Its port is filtered before it ever runs.
	if err := c.Host.AllowPort(c.Box); err != nil {
		return err
	}
	b := c.Box
	r.Add(func() { c.Host.ForgetPort(b) })
	c.undefine = r.Clone()
	r.Success()
	return nil
}

func (c *Creation) undoDefine() {
	if c.undefine != nil {
		c.undefine.Fail()
	}
}

// start boots the box.
func (c *Creation) start(context.Context) error {
	if err := c.Dom.Create(); err != nil {
		return fmt.Errorf("start box %q: %s", c.Name, LibvirtMessage(err))
	}
	return c.Reread()
}

// StartPaused starts QEMU with its vCPUs stopped (a clone loads its state
// first).
func (c *Creation) StartPaused(context.Context) error {
	if err := c.Dom.CreateWithFlags(libvirt.DOMAIN_START_PAUSED); err != nil {
		return fmt.Errorf("start clone %q: %s", c.Name, LibvirtMessage(err))
	}
	return c.Reread()
}

// Reread reads the box from its running domain: the vsock CID, the tap and
// the UUID are known only then.
func (c *Creation) Reread() error {
	b, _, err := boxOf(c.Dom)
	if err != nil {
		return fmt.Errorf("read box %q: %w", c.Name, err)
	}
	c.Box = b
	return nil
}

// Destroy stops the box's QEMU (the undo of a start).
func (c *Creation) Destroy() { c.Dom.Destroy() }

func (c *Creation) waitAgent(ctx context.Context) (err error) {
	c.actx, c.cancel = context.WithTimeout(ctx, c.AgentTimeout)
	var bootID string
	c.Agent, bootID, err = c.Host.WaitAgent(c.actx, c.Dom, c.Box)
	if err == nil {
		err = c.checkBoot(bootID)
	}
	return err
}

// checkBoot says whether the agent answered from the guest boot it must
// (BootID).
func (c *Creation) checkBoot(bootID string) error {
	if c.BootID != "" && bootID != "" && bootID != c.BootID {
		return fmt.Errorf("the guest of box %q booted again after its memory was restored (its kernel panicked or it rebooted): "+
			"it is not the running machine of its snapshot; its console log is kept in %s", c.Box.Name, c.Host.Layout().FailedConsoleLog(c.Box.Name))
	}
	return nil
}

func (c *Creation) identify(context.Context) error {
	return c.Host.Reidentify(c.actx, c.Agent, c.Box, c.NewToken, c.Extra...)
}

// AgentIdentify is the agent and identify steps in one round trip, for a
// box whose agent runs already (Host.WaitAgentIdentify): a clone. Should
// the agent answer from another boot than BootID, the identity it took
// dies with the box, which the plan then removes.
func (c *Creation) AgentIdentify(ctx context.Context) (err error) {
	c.actx, c.cancel = context.WithTimeout(ctx, c.AgentTimeout)
	var bootID string
	c.Agent, bootID, err = c.Host.WaitAgentIdentify(c.actx, c.Dom, c.Box, c.NewToken, c.Extra...)
	if err == nil {
		err = c.checkBoot(bootID)
	}
	return err
}
