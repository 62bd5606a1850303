package kvbox

import (
	"context"
	"time"

	"kvbox.dev/kvbox/domain"
)

// Box is a box as kvbox lists it (kvbox ls --json).
type Box struct {
	domain.Box
	// Published are the host ports forwarded to it (kvbox new --publish)
	// while its port holder lives.
	Published []Port `json:"published,omitempty"`
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
	return Box{Box: b, Published: h.publishedPorts(b)}
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
// or at once with force. Its port holder ends first.
func (h *Host) Stop(ctx context.Context, name string, force bool, timeout time.Duration) error {
	if b, err := h.d.Get(name); err == nil {
		if err := h.stopPublish(b); err != nil {
			return err
		}
	}
	return h.d.Stop(ctx, name, timeout, force)
}
