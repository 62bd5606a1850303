package kvbox

import "kvbox.dev/kvbox/base"

// Kind is what sort of failure an error is (base.Kind: base.NotFound,
// base.Busy, base.Invalid, ...): what a front turns into an exit code, an
// HTTP status or a pod condition.
type Kind = base.Kind

// KindOf is the kind of err.
func KindOf(err error) Kind { return base.KindOf(err) }
