package base

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestLock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.lock")
	a, err := Lock(path, true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Lock(path, false); !errors.Is(err, ErrLocked) {
		t.Fatalf("second non-blocking lock: %v, want ErrLocked", err)
	}
	// A waiter that opened the file before the holder removes it must not
	// end up holding the removed file.
	got := make(chan *FileLock)
	go func() {
		l, err := Lock(path, true)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	time.Sleep(50 * time.Millisecond)
	a.RemoveAndUnlock()
	b := <-got
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the waiter holds a lock on a file that is gone: %v", err)
	}
	if _, err := Lock(path, false); !errors.Is(err, ErrLocked) {
		t.Fatalf("lock after the waiter took it: %v, want ErrLocked", err)
	}
	b.RemoveAndUnlock()
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("lock file left: %v", err)
	}
}
