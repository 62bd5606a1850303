package domain

import (
	"context"
	"errors"

	"kvbox.dev/kvbox/base"
)

// Lock takes kvbox's host-wide lock, which serializes every change of
// which boxes exist and which addresses they hold: two `kvbox new` run at
// the same moment from two shells never pick the same address. The wait
// ends with ctx (or the host's Interrupt).
func (h *Host) Lock(ctx context.Context) (unlock func(), err error) {
	l, err := h.wait(ctx, h.Layout().HostLock(), "kvbox's host lock")
	if err != nil {
		return nil, err
	}
	return l.Unlock, nil
}

// lockBox takes the lock of one box, held by commands that change it,
// waiting for another kvbox that holds it until ctx (or the host's
// Interrupt) ends.
func (h *Host) lockBox(ctx context.Context, name string) (*base.FileLock, error) {
	return h.wait(ctx, h.Layout().BoxLock(name), "box "+name)
}

// wait takes the lock at path, for what, until ctx or h.Interrupt ends:
// the caller's context (a request whose client went, a pod deleted) ends
// a wait behind another kvbox's long operation as the CLI's Ctrl-C does.
func (h *Host) wait(ctx context.Context, path, what string) (*base.FileLock, error) {
	stop := ctx.Done()
	if h.Interrupt != nil {
		if stop == nil {
			stop = h.Interrupt
		} else {
			both := make(chan struct{})
			done := make(chan struct{})
			defer close(done)
			go func() {
				select {
				case <-ctx.Done():
				case <-h.Interrupt:
				case <-done:
					return
				}
				close(both)
			}()
			stop = both
		}
	}
	l, err := base.Wait(path, stop, nil)
	if errors.Is(err, base.ErrInterrupted) && ctx.Err() != nil {
		return nil, base.Errorf(base.Interrupted, "%s is busy (another kvbox holds it): gave up waiting: %v", what, context.Cause(ctx))
	}
	return l, err
}

// TryLockBox takes a box's lock without waiting; base.ErrLocked when
// another kvbox holds it. For recovery, which leaves busy boxes alone.
func (h *Host) TryLockBox(name string) (*base.FileLock, error) {
	return base.Lock(h.Layout().BoxLock(name), false)
}
