package vmstate

import (
	"context"
	"maps"
	"slices"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/qmp"
)

// KeepPageCache turns off QEMU's drop-cache on the image files of a box's
// disk: reopened with the options libvirt opened them with, and
// "drop-cache": false, which libvirt has no attribute for.
//
// QEMU activates a box's disk at the end of every incoming migration (a
// clone's load) and again after an outgoing one (a snapshot's
// switch-over, in the pause). On each, file-posix syncs the file and
// drops its whole page cache (POSIX_FADV_DONTNEED), for a migration
// between hosts on shared storage. A kvbox box never leaves its host, and
// the files of its chain are shared: the base image of every box of an
// image, the disk of a snapshot under every clone of it. Each clone and
// each snapshot emptied their page cache for all the others, and paid
// for it in a pause (docs/design.md#page-cache).
//
// fresh says QEMU was just started (a clone's, a waking box's, waiting
// for its state): its nodes are those of its command line, and QEMU is
// not asked for them, a round trip less before the clone runs. Else a
// node is reopened only where it is still the file libvirt opened.
//
// It is best effort: a node libvirt did not open on the command line (a
// block job's, an operator's) keeps its options, and a QEMU that refuses
// the reopen keeps its cache dropping; neither changes what a snapshot or
// a clone holds. It costs a clone a few milliseconds.
func KeepPageCache(ctx context.Context, q *qmp.Client, box string, fresh bool) error {
	opened, err := domain.Blockdevs(box)
	if err != nil {
		return err
	}
	var nodes []qmp.BlockNode
	if fresh {
		nodes = openedNodes(opened)
	} else if nodes, err = q.QueryNamedBlockNodes(ctx); err != nil {
		return err
	}
	reopen := reopenOptions(opened, nodes)
	if len(reopen) == 0 {
		return nil
	}
	if !fresh {
		// QEMU flushes each node it reopens, with the box's disk I/O
		// drained and its vCPUs waiting on QEMU's lock. kvbox writes
		// out what is dirty first, from its own process, while the box
		// runs on, and the box's stall in this step is shorter
		// (docs/design.md#page-cache).
		for _, o := range reopen {
			overlay.SyncFile(o["filename"].(string)) // best effort
		}
	}
	return q.BlockdevReopen(ctx, reopen)
}

// openedNodes are the nodes of a QEMU as its command line opened them.
func openedNodes(opened map[string]map[string]any) []qmp.BlockNode {
	var nodes []qmp.BlockNode
	for _, name := range slices.Sorted(maps.Keys(opened)) {
		drv, _ := opened[name]["driver"].(string)
		file, _ := opened[name]["filename"].(string)
		nodes = append(nodes, qmp.BlockNode{NodeName: name, Drv: drv, File: file})
	}
	return nodes
}

// reopenOptions are the options to reopen each file node in nodes with,
// so that it keeps its page cache: those it was opened with (from
// opened), for a node that is still that file.
func reopenOptions(opened map[string]map[string]any, nodes []qmp.BlockNode) []map[string]any {
	var reopen []map[string]any
	for _, n := range nodes {
		o, ok := opened[n.NodeName]
		if n.Drv != "file" || !ok || o["driver"] != "file" || o["filename"] != n.File {
			continue
		}
		o = maps.Clone(o)
		o["drop-cache"] = false
		reopen = append(reopen, o)
	}
	return reopen
}
