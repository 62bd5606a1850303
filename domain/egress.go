package domain

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/network"
)

// A box's egress policy (Meta.Egress) is enforced from its definition:
// whenever its port is filtered (AllowPort: define, start, resume, the
// port filter made again after a host restart) its address rules are made
// again from it (network.SetEgress) and the proxy's file for its address
// written (egress.WriteBox), or both removed when it has none. A box that
// takes an address another box had gets its own rules, never the other's.

// egressRules are box b's address rules (nil: it has no policy), its
// redirects to its state dir's proxy ports.
func egressRules(b Box) (*network.EgressRules, error) {
	if b.Egress == nil || b.Egress.IsZero() {
		return nil, nil
	}
	c, err := b.Egress.Compile()
	if err != nil {
		return nil, fmt.Errorf("egress policy of box %q: %w", b.Name, err)
	}
	gw, err := netip.ParseAddr(b.Gateway)
	if err != nil {
		return nil, fmt.Errorf("egress policy of box %q: gateway %q: %w", b.Name, b.Gateway, err)
	}
	if b.Dir == "" {
		return nil, fmt.Errorf("egress policy of box %q: its definition names no folder, so no state dir whose proxy serves it", b.Name)
	}
	ports, err := egress.EnsurePorts(stateDirOf(b), nil)
	if err != nil {
		return nil, fmt.Errorf("egress policy of box %q: %w", b.Name, err)
	}
	own := netip.PrefixFrom(b.Addr(), b.Prefix).Masked()
	return &network.EgressRules{Own: own, Gateway: gw, Allow: c.AllowNets, Deny: c.DenyNets, Proxy: len(c.Names) > 0, Ports: ports}, nil
}

// stateDirOf is the state dir box b is of (its folder is STATE/boxes/NAME).
func stateDirOf(b Box) string { return filepath.Dir(filepath.Dir(b.Dir)) }

// applyEgress makes box b's egress rules and proxy file what its
// definition says. The file is written before the rules send anything to
// the proxy, and removed after the rules went.
func (h *Host) applyEgress(b Box) error {
	r, err := egressRules(b)
	if err != nil {
		return err
	}
	root, addr := stateDirOf(b), b.Addr()
	if r != nil && b.Dir != "" {
		if err := egress.WriteBox(root, egress.Box{Name: b.Name, UUID: b.UUID, Addr: addr, Policy: *b.Egress}); err != nil {
			return err
		}
	}
	err = network.SetEgress(addr, r)
	if errors.Is(err, network.ErrNoEgressTable) {
		if _, err = network.EnsureEgress(); err == nil {
			err = network.SetEgress(addr, r)
		}
	}
	if err != nil {
		return err
	}
	if r == nil && b.Dir != "" && h.Owns(b) {
		return egress.RemoveBox(root, addr, "")
	}
	return nil
}

// forgetEgress removes a removed box's egress rules and its proxy file.
func (h *Host) forgetEgress(b Box) error {
	err := network.SetEgress(b.Addr(), nil)
	if b.Dir != "" {
		if ferr := egress.RemoveBox(stateDirOf(b), b.Addr(), b.Name); err == nil {
			err = ferr
		}
		if h.Owns(b) {
			egress.ForgetRefused(stateDirOf(b), b.Name)
		}
	}
	return err
}

// SetEgress replaces box name's egress policy (nil or empty: none) in its
// definition, live and persistent, and at once in its rules: new
// connections meet the new policy; the box is neither paused nor
// restarted.
func (h *Host) SetEgress(ctx context.Context, name string, p *egress.Policy) (Box, error) {
	if p != nil {
		if err := p.Validate(); err != nil {
			return Box{}, err
		}
		if p.IsZero() {
			p = nil
		}
	}
	b, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return Box{}, err
	}
	defer release()
	if !portFiltered(b) {
		return Box{}, base.Errorf(base.Invalid, "box %q has no network (--network none): it sends nothing an egress policy could judge", name)
	}
	b.Egress = p
	if err := writeMeta(dom, b.Meta); err != nil {
		return Box{}, fmt.Errorf("set the egress policy of box %q: %w", name, err)
	}
	if err := h.applyEgress(b); err != nil {
		return Box{}, fmt.Errorf("box %q: its definition holds the new egress policy, but it is not in force: %w", name, err)
	}
	return b, nil
}
