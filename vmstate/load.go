package vmstate

import (
	"context"
	"fmt"
	"time"

	"kvbox.dev/kvbox/qmp"
)

// Load loads the migration stream in path (written with mapped-ram) into
// the paused QEMU of box, started with -incoming defer from a RestoreXML
// definition. With mapped-ram, RAM sits at fixed offsets in the state file
// and, its page bitmap being zeroed (PrepareMapped), none of it is read:
// the box maps it. The capabilities are put back afterwards.
func Load(ctx context.Context, c *qmp.Client, box, path string) error {
	// The load's end activates the disk: it must find the page cache of
	// the files the box shares kept.
	KeepPageCache(ctx, c, box, true)
	// The stream records which capabilities wrote it and QEMU refuses
	// a mismatch ("Capability x-ignore-shared is on, but received
	// capability is off"): Save writes without x-ignore-shared.
	caps := map[string]bool{qmp.CapIgnoreShared: false, qmp.CapMappedRAM: true}
	// No announce at the load's end: the guest would be asked (virtio-net's
	// guest announce, five rounds) to send gratuitous ARPs and neighbour
	// advertisements for the address it is about to give up, on a port
	// that is closed, on cold code while its first contact is served; and
	// QEMU's own RARPs would go nowhere. The box announces its new address
	// itself once re-identified (arp_notify).
	params := map[string]any{qmp.ParamAnnounceRounds: 0}
	restore, err := c.ApplyMigrationSettings(ctx, caps, params)
	if err != nil {
		return err
	}
	if err := c.MigrateIncoming(ctx, "file:"+path); err != nil {
		return errJoin(err, restore(ctx))
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := c.WaitMigration(wctx, 2*time.Millisecond); err != nil {
		return errJoin(err, restore(ctx))
	}
	return restore(ctx)
}

func errJoin(err, more error) error {
	if more == nil {
		return err
	}
	return fmt.Errorf("%w (and: %v)", err, more)
}
