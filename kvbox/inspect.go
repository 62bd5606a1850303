package kvbox

import (
	"context"

	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/snapshot"
)

// Inspection is a snapshot's lineage, its cost on disk and what a host
// needs to restore it (kvbox snapshots inspect --json).
type Inspection struct {
	Name        string          `json:"name"`
	Box         string          `json:"box"`
	Parent      string          `json:"parent,omitempty"`
	Image       string          `json:"image"`
	BaseDisk    string          `json:"base_disk"`
	SizeBytes   int64           `json:"size_bytes"`
	BaseBytes   int64           `json:"base_bytes"`
	MemoryBytes int64           `json:"memory_bytes"`
	Clones      []string        `json:"clones"`
	Needs       snapshot.Compat `json:"needs"`
	HostOK      string          `json:"host_ok"` // "yes", or what this host lacks
}

// Inspect is snapshot name's Inspection, this host's verdict on it
// included.
func (h *Host) Inspect(ctx context.Context, name string) (Inspection, error) {
	s, err := h.snaps.Get(name)
	if err != nil {
		return Inspection{}, err
	}
	compat, err := snapshot.LoadCompat(s.Dir)
	if err != nil {
		return Inspection{}, err
	}
	boxes, err := h.Boxes(ctx)
	if err != nil {
		return Inspection{}, err
	}
	in := Inspection{Name: s.Name, Box: s.Box, Parent: s.Parent, Image: s.Image, BaseDisk: s.BaseDisk,
		SizeBytes: s.SizeBytes, MemoryBytes: s.MemoryBytes, Clones: []string{}, Needs: compat, HostOK: "yes"}
	in.BaseBytes, _ = overlay.Du(s.BaseDisk)
	for _, b := range boxes {
		if b.Snapshot == s.Name {
			in.Clones = append(in.Clones, b.Name)
		}
	}
	typ, err := h.d.DomainType()
	if err != nil {
		return Inspection{}, err
	}
	if err := compat.Check(h.d.Conn(), typ); err != nil {
		in.HostOK = err.Error()
	}
	return in, nil
}
