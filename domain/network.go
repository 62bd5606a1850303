package domain

import (
	"fmt"
	"strings"
)

// RemoveNetwork removes the bridge boxes are put on and kvbox's firewall
// rules for it, refusing (ErrBusy, naming them) while boxes are on it. It
// holds the host lock, so no box is defined on the bridge meanwhile.
func (h *Host) RemoveNetwork() error {
	unlock, err := h.Lock()
	if err != nil {
		return err
	}
	defer unlock()
	boxes, err := h.Boxes()
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
		return fmt.Errorf("%w: boxes %s are on %s; remove them first", ErrBusy, strings.Join(users, ", "), h.Net.Bridge)
	}
	return h.Net.Remove()
}
