package base

import (
	"context"
	"errors"
	"fmt"
)

// Kind is what sort of failure an error is: what a front turns into an
// exit code, an HTTP status or a pod condition. It is kept beside the
// error's message, which never spells it out.
type Kind int

// The kinds of failure. Other is any error that is none of the rest.
const (
	Other Kind = iota
	// NotFound: the box, snapshot, image or path named does not exist.
	NotFound
	// Exists: the name is taken.
	Exists
	// Busy: the thing is in a state that does not allow it now (running,
	// suspended, in use by another kvbox or by boxes).
	Busy
	// Invalid: the request itself is wrong (a bad name, size, flag or file).
	Invalid
	// Unavailable: something kvbox needs is not there (libvirt, root,
	// an agent that does not answer, a feature the guest lacks).
	Unavailable
	// Interrupted: the caller gave up (Ctrl-C, a cancelled context, a lock
	// wait that was ended).
	Interrupted
	// NotDue: a TTL's removal found, under the lock, that the box or
	// snapshot of that name is not the one that expired, or that its
	// deadline moved. Nothing was removed.
	NotDue
)

var kindNames = map[Kind]string{Other: "error", NotFound: "not found", Exists: "already exists", Busy: "busy",
	Invalid: "invalid", Unavailable: "unavailable", Interrupted: "interrupted", NotDue: "not due"}

func (k Kind) String() string { return kindNames[k] }

// sentinel is the error errors.Is matches for a kind.
type sentinel struct{ kind Kind }

func (s *sentinel) Error() string { return s.kind.String() }

// Is matches another sentinel of the same kind.
func (s *sentinel) Is(target error) bool {
	t, ok := target.(*sentinel)
	return ok && t.kind == s.kind
}

// The sentinels of the kinds: errors.Is(err, ErrNotFound) holds for every
// error of kind NotFound, whatever wraps it.
var (
	ErrNotFound    error = &sentinel{NotFound}
	ErrExists      error = &sentinel{Exists}
	ErrBusy        error = &sentinel{Busy}
	ErrInvalid     error = &sentinel{Invalid}
	ErrUnavailable error = &sentinel{Unavailable}
	ErrInterrupted error = &sentinel{Interrupted}
	ErrNotDue      error = &sentinel{NotDue}
)

// Error is a message with its kind. What it wraps (%w in Errorf) is
// reachable through errors.Is and errors.As.
type Error struct {
	Kind Kind
	msg  string
	err  error // the fmt error behind msg, for what it wraps
}

func (e *Error) Error() string { return e.msg }

// Is matches the sentinel of e's kind.
func (e *Error) Is(target error) bool {
	s, ok := target.(*sentinel)
	return ok && s.kind == e.Kind
}

// Unwrap is what the message wrapped with %w.
func (e *Error) Unwrap() []error {
	switch u := e.err.(type) {
	case interface{ Unwrap() []error }:
		return u.Unwrap()
	case interface{ Unwrap() error }:
		if w := u.Unwrap(); w != nil {
			return []error{w}
		}
	}
	return nil
}

// Errorf is fmt.Errorf with a kind: the message says what happened and
// what to do, the kind says what sort of failure it is.
func Errorf(kind Kind, format string, a ...any) error {
	err := fmt.Errorf(format, a...)
	return &Error{Kind: kind, msg: err.Error(), err: err}
}

// KindOf is the kind of err: the first of Interrupted, Invalid, NotFound,
// Exists, Busy, Unavailable and NotDue that anything in its chain has (a
// cancelled context is Interrupted), else Other.
func KindOf(err error) Kind {
	if err == nil {
		return Other
	}
	if errors.Is(err, context.Canceled) {
		return Interrupted
	}
	for _, k := range []Kind{Interrupted, Invalid, NotFound, Exists, Busy, Unavailable, NotDue} {
		if errors.Is(err, &sentinel{k}) {
			return k
		}
	}
	return Other
}
