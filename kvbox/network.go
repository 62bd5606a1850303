package kvbox

import (
	"context"

	"kvbox.dev/kvbox/network"
)

// NetworkUp sets up the Host's bridge and its firewall, with NAT where
// the host has a default route (always with nat), and kvbox's port filter;
// it returns the bridge's status.
func (h *Host) NetworkUp(nat bool) (network.Status, error) {
	ensure := h.cfg.Network.Ensure
	if nat {
		ensure = h.cfg.Network.EnsureNAT
	}
	if err := ensure(); err != nil {
		return network.Status{}, err
	}
	if err := h.d.EnsurePortFilter(); err != nil {
		return network.Status{}, err
	}
	return h.cfg.Network.Status(), nil
}

// RemoveNetwork removes the Host's bridge and kvbox's firewall rules for
// it, refusing (Busy, naming them) while boxes of any state dir are on it.
func (h *Host) RemoveNetwork(ctx context.Context) error { return h.d.RemoveNetwork(ctx) }
