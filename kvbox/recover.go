package kvbox

import (
	"context"

	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/suspend"
)

// recover finishes what a killed kvbox left half-done, in order: snapshots
// being taken (their source box runs on as it was), boxes being created
// (removed), boxes being removed (their folders go), suspends and resumes
// (the box is suspended, or runs, as a whole). Open runs it; Sweep, the
// fifth pass, follows.
func (h *Host) recover(ctx context.Context) {
	if err := snapshot.Recover(ctx, h.d, h.snaps); err != nil {
		h.notify(true, "cleaning up an interrupted snapshot: %v", err)
	}
	removed, err := h.d.RecoverBoxes()
	for _, n := range removed {
		h.notify(false, "removed box %s, whose creation a killed kvbox left half-done", n)
	}
	if err != nil {
		h.notify(true, "cleaning up an interrupted box creation: %v", err)
	}
	for _, n := range h.d.RemoveOrphanFolders(ctx) {
		h.notify(false, "removed the folder of box %s, which no domain has any more", n)
	}
	if err := suspend.RecoverSuspends(ctx, h.d); err != nil {
		h.notify(true, "cleaning up an interrupted suspend or resume: %v", err)
	}
}
