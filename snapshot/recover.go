package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/qmp"
	"kvbox.dev/kvbox/vmstate"
)

// Recover cleans up after snapshots whose kvbox died half-way (killed, or
// the host lost power): the source box gets its migration capabilities
// back, loses the block job, node and bitmap kvbox added, and runs again if
// kvbox had paused it; the half-built folder is removed. A folder that was
// sealed but not yet renamed is complete and is put in place. Snapshots
// still being taken by a live kvbox are left alone.
func Recover(ctx context.Context, h *domain.Host, st Store) error {
	ents, err := os.ReadDir(st.Dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") && strings.HasSuffix(e.Name(), ".removing") {
			errs = append(errs, os.RemoveAll(filepath.Join(st.Dir, e.Name()))) // a delete that was cut short
			continue
		}
		name, ok := strings.CutSuffix(strings.TrimPrefix(e.Name(), "."), ".partial")
		if !ok || !strings.HasPrefix(e.Name(), ".") {
			continue
		}
		if err := recoverOne(ctx, h, st, name); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func recoverOne(ctx context.Context, h *domain.Host, st Store, name string) error {
	unlock, err := lockName(st, name)
	if err != nil {
		return nil // a live kvbox is still at it
	}
	defer unlock()
	dir := st.partialDir(name)
	if _, err := os.Stat(filepath.Join(dir, MetaFile)); err == nil {
		if _, err := os.Stat(filepath.Join(st.Dir, name)); errors.Is(err, os.ErrNotExist) {
			return os.Rename(dir, filepath.Join(st.Dir, name))
		}
	}
	var p partial
	if b, err := os.ReadFile(filepath.Join(dir, partialFile)); err == nil && json.Unmarshal(b, &p) == nil && p.Box != "" {
		if err := undoOnBox(ctx, h, p); err != nil {
			return fmt.Errorf("recover box %q from an interrupted snapshot %q: %w", p.Box, name, err)
		}
	}
	return os.RemoveAll(dir)
}

// undoOnBox puts a box back as it was before an interrupted snapshot: the
// disk copy's job, node and bitmap gone, the memory's copy undone
// (vmstate.Recover).
func undoOnBox(ctx context.Context, h *domain.Host, p partial) error {
	box, dom, err := h.Lookup(p.Box)
	if errors.Is(err, base.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	defer dom.Free()
	if box.UUID != p.BoxUUID || (box.State != domain.StateRunning && box.State != domain.StatePaused) {
		return nil // another box of that name now, or QEMU is gone with all it had
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	q := h.QMP(dom, p.Box)
	q.CancelRunningMigration(ctx)
	if jobs, err := q.QueryJobs(ctx); err == nil && qmp.FindJob(jobs, backupJob) != nil {
		q.JobCancel(ctx, backupJob)
		q.WaitJob(ctx, backupJob, 10*time.Millisecond)
	}
	q.BlockdevDel(ctx, targetNode)
	if top, err := q.TopNode(ctx, diskDevice); err == nil {
		q.BlockDirtyBitmapRemove(ctx, top, p.Bitmap)
	}
	return vmstate.Recover(ctx, q, dom, p.Box, p.Saved)
}

// Remove deletes a snapshot. It refuses while boxes depend on it: clones
// map its state file and their disks are overlays on its disk.
func Remove(ctx context.Context, h *domain.Host, st Store, name string) error {
	return RemoveIf(ctx, h, st, name, nil)
}

// RemoveIf is Remove of the snapshot called name as it is under the host
// lock: check (nil: none) gets it first, and an error from it leaves it.
func RemoveIf(ctx context.Context, h *domain.Host, st Store, name string, check func(Snapshot) error) error {
	// Under the host lock: a clone being defined right now holds it, so
	// it is either listed below or sees the snapshot gone.
	unlock, err := h.Lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	s, err := st.Get(name)
	if err != nil {
		return err
	}
	if check != nil {
		if err := check(s); err != nil {
			return err
		}
	}
	users, err := Clones(h, name)
	if err != nil {
		return err
	}
	if len(users) > 0 {
		return base.Errorf(base.Busy, "snapshot %q is in use by boxes %s (their memory and disks build on it); remove them first",
			name, strings.Join(users, ", "))
	}
	// Rename first: the snapshot disappears from listings at once, and a
	// crash during the delete leaves only a hidden folder.
	gone := filepath.Join(st.Dir, "."+name+".removing")
	os.RemoveAll(gone)
	if err := os.Rename(s.Dir, gone); err != nil {
		return err
	}
	return os.RemoveAll(gone)
}

// Clones lists the boxes cloned from the named snapshot.
func Clones(h *domain.Host, name string) ([]string, error) {
	boxes, err := h.Boxes()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, b := range boxes {
		if b.Snapshot == name {
			out = append(out, b.Name)
		}
	}
	return out, nil
}
