package snapshot

import (
	"context"
	"path/filepath"
	"sort"
	"strings"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/overlay"
)

// ImageUsers maps each base disk that boxes or snapshots build on to their
// names ("box dev", "snapshot warm").
func ImageUsers(ctx context.Context, h *domain.Host, st Store) (map[string][]string, error) {
	users := map[string][]string{}
	boxes, err := h.Boxes()
	if err != nil {
		return nil, err
	}
	for _, b := range boxes {
		chain, err := overlay.InfoChain(ctx, b.Disk())
		if err != nil {
			continue // a box without its disk builds on nothing
		}
		for _, im := range chain[1:] {
			users[im.Filename] = append(users[im.Filename], "box "+b.Name)
		}
	}
	snaps, err := st.List()
	if err != nil {
		return nil, err
	}
	for _, s := range snaps {
		users[s.BaseDisk] = append(users[s.BaseDisk], "snapshot "+s.Name)
	}
	return users, nil
}

// RemoveImage deletes the image called name, every version of it, unless a
// box or a snapshot builds on one (ErrBusy, naming them). It holds the host
// lock, so no box is defined on the image meanwhile.
func RemoveImage(ctx context.Context, h *domain.Host, st Store, images image.Store, name string) error {
	im, err := images.Get(name)
	if err != nil {
		return err
	}
	users, unlock, err := lockedUsers(ctx, h, st)
	if err != nil {
		return err
	}
	defer unlock()
	var names []string
	for disk, us := range users {
		if strings.HasPrefix(disk, filepath.Dir(filepath.Dir(im.Disk))+"/") {
			names = append(names, us...)
		}
	}
	if names != nil {
		sort.Strings(names)
		return base.Errorf(base.Busy, "image %q is the base of %s; remove them first", name, strings.Join(names, ", "))
	}
	return images.Remove(name)
}

// PruneVersionOf runs PruneImage for the image that disk, the base disk
// of a box or snapshot just removed, is an old version of: the last box or
// snapshot on a version takes it with it. A disk that is no image's, or
// its current version, costs nothing (no look at the other boxes).
func PruneVersionOf(ctx context.Context, h *domain.Host, st Store, images image.Store, disk string) error {
	name, ok := images.OldVersionOf(disk)
	if !ok {
		return nil
	}
	return PruneImage(ctx, h, st, images, name)
}

// PruneImage removes the older versions of the image called name that no
// box or snapshot builds on.
func PruneImage(ctx context.Context, h *domain.Host, st Store, images image.Store, name string) error {
	users, unlock, err := lockedUsers(ctx, h, st)
	if err != nil {
		return err
	}
	defer unlock()
	return images.Prune(name, func(disk string) bool { return users[disk] != nil })
}

// lockedUsers takes the host lock and returns ImageUsers under it; the
// caller unlocks once it has acted on them.
func lockedUsers(ctx context.Context, h *domain.Host, st Store) (map[string][]string, func(), error) {
	unlock, err := h.Lock(ctx)
	if err != nil {
		return nil, nil, err
	}
	users, err := ImageUsers(ctx, h, st)
	if err != nil {
		unlock()
		return nil, nil, err
	}
	return users, unlock, nil
}
