package base

import (
	"errors"
	"path/filepath"
	"testing"
	"time"
)

// A wait on a lock another kvbox holds ends when stop closes (the CLI
// closes it on Ctrl-C or SIGTERM), and the lock is taken once it is free.
func TestLockWaitInterrupt(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "lock")
	held, err := Lock(path, false)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		l, err := Wait(path, stop, nil)
		if err == nil {
			l.Unlock()
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
		if !errors.Is(err, ErrInterrupted) || KindOf(err) != Interrupted {
			t.Fatalf("interrupted Lock: %v, want ErrInterrupted", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Lock did not return after Interrupt closed")
	}
	held.Unlock()

	// Once free, the lock is taken, with or without Interrupt.
	said := 0
	l, err := Wait(path, make(chan struct{}), func() { said++ })
	if err != nil || said != 0 {
		t.Fatalf("Wait on a free lock: %v, said it waits %d times", err, said)
	}
	l.Unlock()
}
