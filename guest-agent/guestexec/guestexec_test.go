package guestexec

import (
	"strings"
	"testing"
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
