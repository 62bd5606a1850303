package domain

import (
	"errors"
	"path/filepath"
	"testing"
	"time"
)

// A wait on a lock another kvbox holds ends when Interrupt closes (the CLI
// closes it on Ctrl-C or SIGTERM), and the lock is taken once it is free.
func TestLockWaitInterrupt(t *testing.T) {
	dir := t.TempDir()
	held, err := LockFile(filepath.Join(dir, "lock"), false)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	h := &Host{StateDir: dir, Interrupt: stop}
	done := make(chan error, 1)
	go func() {
		unlock, err := h.Lock()
		if err == nil {
			unlock()
		}
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("Lock returned %v while another holds the lock", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(stop)
	select {
	case err := <-done:
		if !errors.Is(err, ErrInterrupted) {
			t.Fatalf("interrupted Lock: %v, want ErrInterrupted", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Lock did not return after Interrupt closed")
	}
	held.Unlock()

	// Once free, the lock is taken, with or without Interrupt.
	h.Interrupt = make(chan struct{})
	unlock, err := h.Lock()
	if err != nil {
		t.Fatal(err)
	}
	unlock()
}
