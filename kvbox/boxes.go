package kvbox

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/statedir"
)

// Box is a box as kvbox lists it (kvbox ls --json).
type Box struct {
	domain.Box
	// Published are the host ports forwarded to it (kvbox new --publish)
	// while its port holder lives.
	Published []Port `json:"published,omitempty"`
	// Labels are what its creator attached to it (a sandbox's metadata,
	// a pod's namespace, name and uid). They are kept root's alone in the
	// state dir, never in the domain XML, which libvirt's read-only
	// connection shows to every local user: their values may be secrets.
	Labels map[string]string `json:"labels,omitempty"`
}

// State is what a box is doing (domain.State).
type State = domain.State

// The states of a box; StatePMSuspended (a guest asleep in ACPI S3) is not
// kvbox's StateSuspended.
const (
	StateRunning     = domain.StateRunning
	StatePaused      = domain.StatePaused
	StateStopped     = domain.StateStopped
	StateCrashed     = domain.StateCrashed
	StateSuspended   = domain.StateSuspended
	StatePMSuspended = domain.StatePMSuspended
)

// Boxes lists this state dir's boxes, sorted by name.
func (h *Host) Boxes(ctx context.Context) ([]Box, error) {
	bs, err := h.d.Boxes()
	if err != nil {
		return nil, err
	}
	out := make([]Box, 0, len(bs))
	for _, b := range bs {
		out = append(out, h.box(b))
	}
	return out, nil
}

// Box is the named box.
func (h *Host) Box(ctx context.Context, name string) (Box, error) {
	b, err := h.d.Get(name)
	if err != nil {
		return Box{}, err
	}
	return h.box(b), nil
}

// box is b with what kvbox keeps of it besides libvirt.
func (h *Host) box(b domain.Box) Box {
	return Box{Box: b, Published: h.publishedPorts(b), Labels: h.labels(b)}
}

// labelsRecord is a box's labels file: its UUID (the labels of an earlier
// box of its name are not this one's) and its labels.
type labelsRecord struct {
	UUID   string            `json:"uuid"`
	Labels map[string]string `json:"labels"`
}

// maxLabels bounds what is read of a labels file.
const maxLabels = 1 << 20

// labels are box b's labels (nil without any).
func (h *Host) labels(b domain.Box) map[string]string {
	data, err := readBounded(h.layout.Labels(b.Name), maxLabels)
	var r labelsRecord
	if err != nil || json.Unmarshal(data, &r) != nil || r.UUID == "" || r.UUID != b.UUID {
		return nil
	}
	return r.Labels
}

// setLabels keeps box b's labels, root's alone (0600 in a 0700 folder).
func (h *Host) setLabels(b domain.Box, labels map[string]string) error {
	if len(labels) == 0 {
		return nil
	}
	for k := range labels {
		if k == "" {
			return base.Errorf(base.Invalid, "a label needs a name")
		}
	}
	data, err := json.Marshal(labelsRecord{UUID: b.UUID, Labels: labels})
	if err != nil {
		return err
	}
	if len(data) > maxLabels {
		return base.Errorf(base.Invalid, "labels of box %q: %d bytes, at most %d", b.Name, len(data), maxLabels)
	}
	path := h.layout.Labels(b.Name)
	if err := os.MkdirAll(filepath.Dir(path), statedir.PrivateDirMode); err != nil {
		return err
	}
	return overlay.WriteFileAtomic(path, data, 0o600)
}

// Start boots a stopped box, waits until its agent answers (agentTimeout,
// 90s when 0; a box whose agent does not answer is left running, for its
// console to tell why) and binds its published ports again. The Box it
// returns lists as Published the ports it bound again (none when the box
// has none, or its port holder still ran).
func (h *Host) Start(ctx context.Context, name string, agentTimeout time.Duration) (Box, error) {
	if agentTimeout <= 0 {
		agentTimeout = 90 * time.Second
	}
	b, err := h.d.Start(ctx, name, agentTimeout)
	if err != nil {
		return Box{}, err
	}
	ports, err := h.republish(b)
	return Box{Box: b, Published: ports}, err
}

// Stop shuts box name down through ACPI and pulls the plug after timeout,
// or at once with force. Its port holder and agent streams end first.
func (h *Host) Stop(ctx context.Context, name string, force bool, timeout time.Duration) error {
	if b, err := h.d.Get(name); err == nil {
		if err := h.stopPublish(b); err != nil {
			return err
		}
	}
	h.dropForwarder(name)
	return h.d.Stop(ctx, name, timeout, force)
}
