package kvbox

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"kvbox.dev/kvbox/base"
)

// A wait for a box's lock, which another kvbox holds through a long
// operation, ends with its caller's context (a request whose client went,
// a pod deleted), not only with the host's; once the lock is free, the
// same call goes through.
func TestBoxLockWaitEndsWithTheCallersContext(t *testing.T) {
	a, h := testDriverHost(t)
	name := "kvbox-unit-lockwait"
	t.Cleanup(func() {
		if d, err := h.Conn().LookupDomainByName(name); err == nil {
			d.Undefine()
			d.Free()
		}
	})
	defineTestBox(t, h, name, nil)
	held, err := base.Lock(h.Layout().BoxLock(name), false)
	if err != nil {
		t.Fatal(err)
	}
	at := time.Now().Add(time.Hour)
	calls := map[string]func(context.Context) error{
		"SetExpires": func(ctx context.Context) error { _, err := a.SetExpires(ctx, name, &at); return err },
		"Stop":       func(ctx context.Context) error { return a.Stop(ctx, name, true, time.Second) },
		"SetLabels":  func(ctx context.Context) error { _, err := a.SetLabels(ctx, name, nil); return err },
	}
	for what, call := range calls {
		ctx, cancel := context.WithCancelCause(context.Background())
		gone := errors.New("the client went away")
		done := make(chan error, 1)
		go func() { done <- call(ctx) }()
		select {
		case err := <-done:
			t.Fatalf("%s with the box's lock held elsewhere returned before its context ended: %v", what, err)
		case <-time.After(100 * time.Millisecond):
		}
		cancel(gone)
		err := <-done
		if !errors.Is(err, base.ErrInterrupted) {
			t.Errorf("%s: %v, want an interrupted wait", what, err)
		} else if !strings.Contains(err.Error(), "box "+name+" is busy") || !strings.Contains(err.Error(), gone.Error()) {
			t.Errorf("%s: %q: want it to name the box and why the wait ended", what, err)
		}
	}
	held.Unlock()
	if _, err := a.SetExpires(context.Background(), name, &at); err != nil {
		t.Errorf("SetExpires once the lock is free: %v", err)
	}
}
