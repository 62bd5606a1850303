package kvbox

import (
	"fmt"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/image"
)

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
	if err := checkEgress(req.Egress); err != nil {
		return domain.Spec{}, err
	}
	if noNet && nonZero(req.Egress) != nil {
		return domain.Spec{}, base.Errorf(base.Invalid, "--egress with --network none: a box without network sends nothing a policy could judge")
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
		AgentTimeout: timeout, NoNetwork: noNet, Group: group, Labels: ls, Egress: nonZero(req.Egress),
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

// nonZero is p, or nil when p allows everything.
func nonZero(p *egress.Policy) *egress.Policy {
	if p == nil || p.IsZero() {
		return nil
	}
	return p
}
