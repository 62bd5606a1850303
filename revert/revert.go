// Package revert undoes the completed steps of a multi-step host change when
// a later step fails, in reverse order (after Incus' shared/revert):
//
//	r := revert.New()
//	defer r.Fail()
//	... r.Add(undoStep) after each step ...
//	r.Success()
package revert

// Reverter collects undo functions.
type Reverter struct {
	fns  []func()
	done bool
}

// New returns an empty Reverter.
func New() *Reverter { return &Reverter{} }

// Add registers an undo function for a step that just succeeded.
func (r *Reverter) Add(f func()) { r.fns = append(r.fns, f) }

// Fail runs the undo functions, newest first, unless Success was called.
func (r *Reverter) Fail() {
	if r.done {
		return
	}
	r.done = true
	for i := len(r.fns) - 1; i >= 0; i-- {
		r.fns[i]()
	}
}

// Success keeps every step: Fail becomes a no-op.
func (r *Reverter) Success() { r.done = true }

// Clone returns a new Reverter holding the undo functions added so far, and
// leaves this one as it is. A function that must hand its undo to its caller
// clones, then calls Success on its own: the caller's Fail undoes the work.
func (r *Reverter) Clone() *Reverter {
	return &Reverter{fns: append([]func(){}, r.fns...)}
}
