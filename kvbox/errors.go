package kvbox

import "kvbox.dev/kvbox/base"

// Kind is what sort of failure an error is (base.Kind): what a front turns
// into an exit code, an HTTP status or a pod condition.
type Kind = base.Kind

// The kinds of failure.
const (
	Other       = base.Other
	NotFound    = base.NotFound
	Exists      = base.Exists
	Busy        = base.Busy
	Invalid     = base.Invalid
	Unavailable = base.Unavailable
	Interrupted = base.Interrupted
	NotDue      = base.NotDue
)

// KindOf is the kind of err.
func KindOf(err error) Kind { return base.KindOf(err) }
