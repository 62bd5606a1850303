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
	// Labels are what its creator attached to it (a sandbox's template
	// and metadata, a pod's namespace, name and uid), in the domain's
	// metadata from its definition on (domain.Meta.Labels): a box is never
	// seen without them. libvirt's read-only connection shows them to
	// local users: never a secret (a front keeps its secrets elsewhere, as
	// kvbox serve does in its folder of the state dir).
	Labels map[string]string `json:"labels,omitempty"`
}

// SuspendsAtExpiry says the box's deadline suspends it (and takes itself
// away) instead of removing it (CloneRequest.SuspendAtExpiry).
func (b Box) SuspendsAtExpiry() bool { return b.OnExpiry == domain.ExpirySuspend }

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
	return Box{Box: b, Published: h.publishedPorts(b), Labels: domain.LabelMap(b.Labels)}
}

// SetLabels replaces box name's labels (what its front keeps with it:
// facts, never secrets) and returns the box as it is now.
func (h *Host) SetLabels(ctx context.Context, name string, m map[string]string) (Box, error) {
	ls, err := labels(m)
	if err != nil {
		return Box{}, err
	}
	b, err := h.d.SetLabels(ctx, name, ls)
	if err != nil {
		return Box{}, err
	}
	return h.box(b), nil
}

// labels checks labels and returns them as the domain keeps them: a label
// that could not be kept as given refuses the request before anything is
// made.
func labels(m map[string]string) ([]domain.Label, error) {
	for k, v := range m {
		if err := domain.ValidLabel(k, v); err != nil {
			return nil, err
		}
	}
	return domain.Labels(m), nil
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
