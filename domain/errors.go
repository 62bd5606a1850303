package domain

import "errors"

// Sentinel errors of kvbox. Errors returned by kvbox's packages wrap one of
// them with %w when the cause is one the user can act on; the CLI turns each
// into its own exit code.
var (
	ErrNotFound    = errors.New("not found")
	ErrExists      = errors.New("already exists")
	ErrBusy        = errors.New("busy")
	ErrInvalid     = errors.New("invalid")
	ErrUnavailable = errors.New("unavailable")
)
