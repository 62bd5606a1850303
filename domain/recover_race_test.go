package domain

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"kvbox.dev/kvbox/base"
)

// A creation marker is locked from the first moment it can be seen: a
// recovering kvbox polling for it never gets its lock while the creator
// holds it (with LockFile, which creates and then locks, it could).
func TestCreationMarkerNeverSeenUnlocked(t *testing.T) {
	top := t.TempDir()
	for i := range 300 {
		dir := filepath.Join(top, "b"+string(rune('a'+i%26))+string(rune('a'+i/26)))
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, creatingMarker)
		got := make(chan error, 1)
		go func() {
			for {
				l, err := base.LockExisting(path)
				if err == nil {
					l.Unlock()
					got <- errors.New("a recovering kvbox locked a marker its creator holds")
					return
				}
				if errors.Is(err, base.ErrLocked) {
					got <- nil
					return
				}
			}
		}()
		m, err := base.CreateLocked(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := <-got; err != nil {
			t.Fatalf("iteration %d: %v", i, err)
		}
		m.RemoveAndUnlock()
	}
}

// A marker that its creator removed when the box was complete is gone for
// good: locking it for recovery fails and does not bring it back.
func TestFinishedMarkerIsNotRecreated(t *testing.T) {
	path := filepath.Join(t.TempDir(), creatingMarker)
	m, err := base.CreateLocked(path)
	if err != nil {
		t.Fatal(err)
	}
	// a recovering kvbox opened the marker just before the creator finished
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m.RemoveAndUnlock()
	if l, err := base.LockExisting(path); err == nil {
		l.Unlock()
		t.Fatal("a finished box's marker could be locked for recovery")
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the finished box's marker came back: %v", err)
	}
}
