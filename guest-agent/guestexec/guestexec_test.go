package guestexec

import (
	"strings"
	"testing"
	"time"
)

func TestLookupUserAndWorkdir(t *testing.T) {
	u, err := LookupUser("root")
	if err != nil || u.UID != 0 || u.Home == "" {
		t.Fatalf("LookupUser(root) = %+v, %v", u, err)
	}
	if u, err := LookupUser("4242"); err != nil || u.UID != 4242 || u.GID != 0 || u.Home != "/" {
		t.Errorf("LookupUser(4242) = %+v, %v", u, err)
	}
	if _, err := LookupUser("no-such-user-kvbox"); err == nil || !strings.HasPrefix(err.Error(), "user no-such-user-kvbox: no such user") {
		t.Errorf("lookupUser of a missing user: %v", err)
	}
	for dir, want := range map[string]string{
		"/nonexistent-kvbox": "workdir /nonexistent-kvbox: no such directory in the box",
		"/etc/passwd":        "workdir /etc/passwd: not a directory",
	} {
		if err := CheckWorkdir(dir); err == nil || err.Error() != want {
			t.Errorf("CheckWorkdir(%s) = %v, want %q", dir, err, want)
		}
	}
	if err := CheckWorkdir("/tmp"); err != nil {
		t.Error(err)
	}
}

// A process's output is read DrainIdle past its last data after the exit,
// never past DrainMax after the exit.
func TestDrainDeadline(t *testing.T) {
	var d Drain
	if d.Done() {
		t.Fatal("a zero Drain is of an exited process")
	}
	d.Exited()
	before := time.Now()
	if dl := d.Deadline(); !d.Done() || dl.Before(before.Add(DrainIdle-time.Millisecond)) || dl.After(time.Now().Add(DrainIdle)) {
		t.Errorf("right after the exit: deadline %v from now, want %v", dl.Sub(before), DrainIdle)
	}
	exit := time.Now().Add(-DrainMax + DrainIdle/2)
	d.at.Store(exit.UnixNano())
	if dl := d.Deadline(); !dl.Equal(exit.Add(DrainMax)) {
		t.Errorf("near DrainMax after the exit: deadline %v after the exit, want %v", dl.Sub(exit), DrainMax)
	}
}
