// Package snapshot freezes running boxes into snapshots (memory, CPU and
// device state, disk) and starts warm clones from them.
//
// A snapshot is a folder under the state directory's snapshots/:
//
//	snapshot.json  what is in the folder; written last, so its presence
//	               marks a complete snapshot
//	domain.xml     the source's live domain XML: clones are derived from it
//	               so machine type, CPU model and devices match exactly
//	state          the migration stream, written with mapped-ram: CPU and
//	               device state, and the RAM at fixed offsets (sparse)
//	disk.qcow2     the disk, standalone above the base image
//
// A folder is built under a hidden temporary name and renamed into place
// once every file in it is synced, so a crash never leaves a listed half
// snapshot.
package snapshot

import (
	"path/filepath"
	"sort"
	"time"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/statedir"
)

// Files in a snapshot folder.
const (
	MetaFile      = "snapshot.json"
	DomainXMLFile = "domain.xml"
	StateFile     = "state"
	DiskFile      = "disk.qcow2"
)

// Memory says where a snapshot's RAM is and how a clone maps it.
type Memory struct {
	// File is StateFile, relative to the snapshot folder: the state
	// stream, written with the mapped-ram capability.
	File string `json:"file"`
	// Offset of the RAM's first byte in File (mapped-ram: the pages
	// offset of the RAM block).
	Offset int64 `json:"offset"`
}

// Snapshot is a complete snapshot.
type Snapshot struct {
	Name       string    `json:"name"`
	Box        string    `json:"box"`
	BoxUUID    string    `json:"box_uuid"`
	Created    time.Time `json:"created"`
	Image      string    `json:"image"`     // base image of the disk chain
	BaseDisk   string    `json:"base_disk"` // the base image's disk: disk.qcow2's backing file
	BaseFormat string    `json:"base_format"`
	Parent     string    `json:"parent,omitempty"` // snapshot the box was cloned from, if any
	// GuestBootID is the guest kernel's boot_id when the snapshot was taken
	// (empty when its agent did not say): a clone answering with another
	// booted again after its restore, and is refused.
	GuestBootID string `json:"guest_boot_id,omitempty"`
	Memory      Memory `json:"memory"`
	CPUs        int    `json:"cpus"`
	MemoryBytes int64  `json:"memory_bytes"`
	DiskBytes   int64  `json:"disk_bytes"`
	// Bitmap is the persistent dirty bitmap left on the source's disk
	// that tracks blocks changed since this snapshot: the next snapshot
	// of the same box copies only those.
	Bitmap string `json:"bitmap,omitempty"`
	// Incremental says the disk part copied only blocks changed since
	// the previous snapshot of the box (then merged to stand alone).
	Incremental bool `json:"incremental"`
	// DiskCopiedBytes is what the disk copy wrote (before the merge).
	DiskCopiedBytes int64 `json:"disk_copied_bytes"`
	PauseMillis     int64 `json:"pause_ms"`
	// Expires is the snapshot's deadline (snapshots new --ttl): it is
	// removed then, or, while boxes are cloned from it, once they are gone.
	Expires *time.Time `json:"expires,omitempty"`

	Dir       string `json:"-"`
	SizeBytes int64  `json:"size_bytes"` // real bytes on disk, computed on read
}

// Path returns a file of the snapshot.
func (s Snapshot) Path(file string) string { return filepath.Join(s.Dir, file) }

// Store is the folder of snapshots.
type Store struct{ Dir string }

// Get returns the named complete snapshot.
func (st Store) Get(name string) (Snapshot, error) {
	var s Snapshot
	if err := st.entries().Read(name, &s); err != nil {
		return Snapshot{}, err
	}
	s.Dir = filepath.Join(st.Dir, name)
	s.SizeBytes, _ = overlay.Du(s.Dir)
	return s, nil
}

// entries is the store's folder of snapshots: one folder a snapshot
// (a dot folder is one being made), complete once snapshot.json is in it.
func (st Store) entries() statedir.Entries {
	return statedir.Entries{Dir: st.Dir, Record: MetaFile, What: "snapshot", Missing: "does not exist (kvbox snapshots ls lists them)"}
}

// List returns every complete snapshot, oldest first.
func (st Store) List() ([]Snapshot, error) {
	out, err := statedir.List(st.Dir, st.Get)
	if err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

// SetExpires records the snapshot's deadline (nil: none) in its
// snapshot.json, which stays root's and read-only to QEMU.
func SetExpires(h *domain.Host, st Store, name string, at *time.Time) (Snapshot, error) {
	s, err := st.Get(name)
	if err != nil {
		return Snapshot{}, err
	}
	if at != nil {
		t := at.UTC().Truncate(time.Second)
		at = &t
	}
	s.Expires = at
	path := s.Path(MetaFile)
	if err := writeJSON(path, s); err != nil {
		return Snapshot{}, err
	}
	if err := h.ShareWithQEMU(path, statedir.SharedFileMode); err != nil {
		return Snapshot{}, err
	}
	return s, overlay.SyncDir(s.Dir)
}
