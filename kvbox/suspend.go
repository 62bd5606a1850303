package kvbox

import (
	"context"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/progress"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/suspend"
)

// Suspend saves box name's memory and device state to disk and ends its
// QEMU: it holds no RAM and no CPU until Resume.
func (h *Host) Suspend(ctx context.Context, name string, p progress.Reporter) (suspend.SuspendResult, error) {
	st := progress.Of(p).Stage("saving " + name)
	defer st.End()
	h.dropForwarder(name)
	return suspend.Suspend(ctx, h.d, name)
}

// How is how Resume woke a box.
type How string

// The ways Resume wakes a box.
const (
	Unpaused  How = "unpaused"   // it was paused (a failed snapshot left it so): it continues
	Woken     How = "woken"      // its guest was asleep (ACPI S3, libvirt's pmsuspended)
	FromSaved How = "from-saved" // kvbox suspended it: it runs again from its saved state
)

// Resumed is what Resume did.
type Resumed struct {
	Box   Box
	How   How
	Total time.Duration // FromSaved: from the call to the agent's answer
	Steps step.Timings
}

// Resume wakes box name: a box kvbox suspended runs again from its saved
// state (same name, MAC and address, every process running on;
// agentTimeout bounds the wait for its agent), a paused one continues, a
// guest asleep in S3 is woken. Any other box is refused (Busy).
func (h *Host) Resume(ctx context.Context, name string, agentTimeout time.Duration, p progress.Reporter) (Resumed, error) {
	b, err := h.d.Get(name)
	if err != nil {
		return Resumed{}, err
	}
	switch b.State {
	case domain.StatePaused:
		b, err := h.d.Unpause(ctx, name)
		return Resumed{Box: h.box(b), How: Unpaused}, err
	case domain.StatePMSuspended:
		b, err := h.d.Wake(ctx, name)
		return Resumed{Box: h.box(b), How: Woken}, err
	case domain.StateSuspended:
	default:
		return Resumed{}, base.Errorf(base.Busy, "box %q is %s, neither suspended nor paused", name, b.State)
	}
	st := progress.Of(p).Stage("waking " + name)
	res, err := suspend.Resume(ctx, h.d, name, agentTimeout)
	st.End()
	if err != nil {
		return Resumed{Steps: res.Steps}, err
	}
	return Resumed{Box: h.box(res.Box), How: FromSaved, Total: res.Total, Steps: res.Steps}, nil
}

// Resumable says a box in state s is woken by Resume, not booted by Start.
func Resumable(s State) bool {
	return s == domain.StatePaused || s == domain.StateSuspended || s == domain.StatePMSuspended
}
