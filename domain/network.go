package domain

import (
	"context"
	"strings"

	"kvbox.dev/kvbox/base"
)

// RemoveNetwork removes the bridge boxes are put on and kvbox's firewall
// rules for it, refusing (Busy, naming them) while boxes are on it. It
// holds the host lock, so no box is defined on the bridge meanwhile.
func (h *Host) RemoveNetwork(ctx context.Context) error {
	unlock, err := h.Lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	boxes, err := h.AllBoxes() // another state dir's boxes may be on it too
	if err != nil {
		return err
	}
	var users []string
	for _, b := range boxes {
		if b.Bridge == h.Net.Bridge {
			users = append(users, b.Name)
		}
	}
	if users != nil {
		return base.Errorf(base.Busy, "boxes %s are on %s; remove them first", strings.Join(users, ", "), h.Net.Bridge)
	}
	return h.Net.Remove()
}

// lockedBoxes takes the host lock and lists the boxes: none is defined or
// removed until unlock.
func (h *Host) lockedBoxes(ctx context.Context) ([]Box, func(), error) {
	unlock, err := h.Lock(ctx)
	if err != nil {
		return nil, nil, err
	}
	boxes, err := h.Boxes()
	if err != nil {
		unlock()
		return nil, nil, err
	}
	return boxes, unlock, nil
}
