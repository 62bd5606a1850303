package base

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
)

// The kind is beside the message: the message is what was written, the
// kind survives wrapping, and what the message wrapped stays reachable.
func TestErrorKinds(t *testing.T) {
	cause := &os.PathError{Op: "open", Path: "/x", Err: os.ErrNotExist}
	err := Errorf(NotFound, "box %q does not exist (kvbox ls lists boxes)", "dev")
	wrapped := fmt.Errorf("remove: %w", err)
	for _, tc := range []struct {
		err  error
		kind Kind
		msg  string
	}{
		{err, NotFound, `box "dev" does not exist (kvbox ls lists boxes)`},
		{wrapped, NotFound, `remove: box "dev" does not exist (kvbox ls lists boxes)`},
		{Errorf(Busy, "box %q is running: %w", "a", cause), Busy, `box "a" is running: open /x: file does not exist`},
		{fmt.Errorf("x: %w", ErrInterrupted), Interrupted, "x: interrupted"},
		{fmt.Errorf("dial: %w", context.Canceled), Interrupted, "dial: context canceled"},
		{errors.New("plain"), Other, "plain"},
		{Errorf(Invalid, "both: %w", Errorf(NotFound, "gone")), Invalid, "both: gone"},
		{errors.Join(Errorf(Exists, "taken"), Errorf(Unavailable, "down")), Exists, "taken\ndown"},
	} {
		if got := KindOf(tc.err); got != tc.kind {
			t.Errorf("KindOf(%q) = %v, want %v", tc.err, got, tc.kind)
		}
		if tc.err.Error() != tc.msg {
			t.Errorf("message %q, want %q", tc.err, tc.msg)
		}
	}
	if !errors.Is(wrapped, ErrNotFound) || errors.Is(wrapped, ErrBusy) {
		t.Error("errors.Is does not follow the kind")
	}
	var pe *os.PathError
	if e := Errorf(Busy, "x: %w", cause); !errors.As(e, &pe) || !errors.Is(e, os.ErrNotExist) {
		t.Error("what the message wrapped is not reachable")
	}
	if KindOf(nil) != Other {
		t.Error("KindOf(nil)")
	}
}
