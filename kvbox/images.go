package kvbox

import (
	"context"

	"kvbox.dev/kvbox/snapshot"
)

// RemoveImage deletes base image name, every version of it, unless a box
// or snapshot builds on it.
func (h *Host) RemoveImage(ctx context.Context, name string) error {
	return snapshot.RemoveImage(ctx, h.d, h.snaps, h.images, name)
}

// PruneImage removes the older versions of image name that no box or
// snapshot builds on any more (after a new version is imported or built:
// the others go with the last of their boxes and snapshots).
func (h *Host) PruneImage(ctx context.Context, name string) error {
	return snapshot.PruneImage(ctx, h.d, h.snaps, h.images, name)
}
