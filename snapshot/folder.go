package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/statedir"
	"kvbox.dev/kvbox/vmstate"
)

// partial is what a snapshot in progress records in its temporary folder
// before it changes anything, so Recover can undo it when kvbox dies.
type partial struct {
	Name    string `json:"name"`
	Box     string `json:"box"`
	BoxUUID string `json:"box_uuid"`
	PID     int    `json:"pid"`
	Bitmap  string `json:"bitmap"`
	// Saved is what the memory's copy changes in QEMU, as it was.
	Saved vmstate.Record `json:"saved"`
}

const partialFile = "partial.json"

// partialDir is where a snapshot is built before it is renamed into place.
func (st Store) partialDir(name string) string { return filepath.Join(st.Dir, "."+name+".partial") }

// makeFolder makes the partial folder, root's: QEMU's group traverses it
// to write the two files kvbox makes for it, the state (here, empty, until
// QEMU's migration fills it) and the disk copy (at make-rest), and QEMU's
// user can put nothing else in it, so no name kvbox opens there can be a
// link planted by a QEMU that the box took over.
func (c *creation) makeFolder(context.Context) error {
	os.RemoveAll(c.tmp) // ours: we hold the name lock
	if err := os.Mkdir(c.tmp, 0o750); err != nil {
		return err
	}
	// setgid: what kvbox makes in it is QEMU's group (the snapshot's files
	// stay readable to QEMU through it; anything else has no world bits).
	err := c.h.ShareWithQEMU(c.tmp, statedir.SharedDirMode|os.ModeSetgid)
	if err == nil {
		err = makeForQEMU(c.h, c.save.Path)
	}
	if err != nil {
		os.RemoveAll(c.tmp)
	}
	return err
}

// removeFolder is the last undo. The steps' own undos have put the box
// back (the memory's copy undone once, by vmstate.Save.Undo); when that
// failed while the box's QEMU runs (QEMU or libvirt did not answer,
// libvirtd restarting), the folder and its record stay, and the next
// kvbox command's Recover finishes the job.
func (c *creation) removeFolder() {
	if c.p.Box != "" && c.save.Undo() != nil && qemuRuns(c.dom) {
		return
	}
	os.RemoveAll(c.tmp)
	if c.token != nil {
		// The box's agent may have the snapshot's token, which no
		// snapshot keeps now: the box, running again, gets one of its
		// own (or at its next contact, if it does not answer).
		c.renewToken(context.Background())
	}
}

// qemuRuns reports whether dom's QEMU still runs (or may: libvirt did not
// say).
func qemuRuns(dom *libvirt.Domain) bool {
	st, _, err := dom.GetState()
	return err != nil || st == libvirt.DOMAIN_RUNNING || st == libvirt.DOMAIN_PAUSED
}

// makeForQEMU creates an empty file that QEMU's user will write.
func makeForQEMU(h *domain.Host, path string) error {
	f, err := createNew(path)
	if err != nil {
		return err
	}
	f.Close()
	return h.ChownForQEMU(path)
}

// createNew creates a file of the partial folder, which must not exist yet
// (O_EXCL: nothing in its place is written through).
func createNew(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o640)
}

// writePartial writes the record of a snapshot in progress into its
// folder.
func writePartial(dir string, p partial) error {
	b, err := json.Marshal(p)
	if err != nil {
		return err
	}
	f, err := createNew(filepath.Join(dir, partialFile))
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// writeCompat writes what a restore of the snapshot in dir needs, with
// this host's versions today and the version of the agent in the box, so
// a later upgrade of this host (or a pull on another) checks against the
// QEMU that wrote the state, not against whatever runs then.
func writeCompat(dir string, compat Compat) error {
	b, err := json.Marshal(compat)
	if err != nil {
		return err
	}
	return overlay.WriteFileAtomic(filepath.Join(dir, CompatFile), b, 0o640)
}

// seal makes a built snapshot folder durable and read-only: every file is
// synced, snapshot.json is written last, and the files belong to root again.
func seal(h *domain.Host, dir string, s Snapshot) error {
	os.Remove(filepath.Join(dir, partialFile))
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := sealFile(h, filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	if err := writeJSON(filepath.Join(dir, MetaFile), s); err != nil {
		return err
	}
	if err := h.ShareWithQEMU(filepath.Join(dir, MetaFile), statedir.SharedFileMode); err != nil {
		return err
	}
	return h.ShareWithQEMU(dir, statedir.SharedDirMode)
}

// sealFile syncs one file of a snapshot folder and makes it root's,
// read-only to QEMU through its group (the agent's token root's alone). It
// is never followed: QEMU's user wrote in the folder.
func sealFile(h *domain.Host, p string) error {
	f, err := domain.OpenNoFollow(p, os.O_RDONLY)
	if err != nil {
		return err
	}
	err = f.Sync()
	if err == nil && filepath.Base(p) == domain.AgentTokenFile {
		// Root's only: QEMU needs it no more than anyone else.
		err = f.Chmod(0o400)
		f.Close()
		return err
	}
	f.Close()
	if err != nil {
		return fmt.Errorf("sync %s: %w", p, err)
	}
	return h.ShareWithQEMU(p, statedir.SharedFileMode)
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return overlay.WriteFileAtomic(path, append(b, '\n'), 0o640)
}

// lockName holds a snapshot name while a snapshot of that name is built or
// recovered; the lock file goes with the unlock.
func lockName(st Store, name string) (func(), error) {
	l, err := base.Lock(filepath.Join(st.Dir, "."+name+".lock"), false)
	if errors.Is(err, base.ErrLocked) {
		return nil, base.Errorf(base.Busy, "snapshot %q is being taken by another kvbox", name)
	}
	if err != nil {
		return nil, err
	}
	return l.RemoveAndUnlock, nil
}
