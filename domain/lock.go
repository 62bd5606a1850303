package domain

import "kvbox.dev/kvbox/base"

// Lock takes kvbox's host-wide lock, which serializes every change of
// which boxes exist and which addresses they hold: two `kvbox new` run at
// the same moment from two shells never pick the same address.
func (h *Host) Lock() (unlock func(), err error) {
	l, err := base.Wait(h.Layout().HostLock(), h.Interrupt, nil)
	if err != nil {
		return nil, err
	}
	return l.Unlock, nil
}

// lockBox takes the lock of one box, held by commands that change it.
func (h *Host) lockBox(name string) (*base.FileLock, error) {
	return base.Wait(h.Layout().BoxLock(name), h.Interrupt, nil)
}

// TryLockBox takes a box's lock without waiting; base.ErrLocked when
// another kvbox holds it. For recovery, which leaves busy boxes alone.
func (h *Host) TryLockBox(name string) (*base.FileLock, error) {
	return base.Lock(h.Layout().BoxLock(name), false)
}
