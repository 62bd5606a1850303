package agent

import (
	"slices"
	"strings"
	"testing"
)

// --env adds to the defaults: PATH stays unless it is given.
func TestExecEnvAdd(t *testing.T) {
	for _, tc := range []struct {
		req  ExecRequest
		u    *guestUser
		want []string
	}{
		{ExecRequest{EnvAdd: []string{"CI=1"}}, nil,
			[]string{"PATH=" + defaultPath, "HOME=/root", "CI=1"}},
		{ExecRequest{EnvAdd: []string{"PATH=/x", "A="}}, nil,
			[]string{"PATH=/x", "HOME=/root", "A="}},
		{ExecRequest{EnvAdd: []string{"HOME=/h"}}, &guestUser{name: "app", home: "/home/app"},
			[]string{"PATH=" + defaultPath, "HOME=/h", "USER=app", "LOGNAME=app"}},
		{ExecRequest{Env: []string{"X=1"}, EnvAdd: []string{"X=2", "Y=3"}}, &guestUser{name: "app", home: "/home/app"},
			[]string{"X=2", "Y=3"}},
	} {
		if got := execEnv(tc.req, tc.u); !slices.Equal(got, tc.want) {
			t.Errorf("execEnv(%+v) = %q, want %q", tc.req, got, tc.want)
		}
	}
}

func TestLookupUserAndWorkdir(t *testing.T) {
	u, err := lookupUser("root")
	if err != nil || u.uid != 0 || u.home == "" {
		t.Fatalf("lookupUser(root) = %+v, %v", u, err)
	}
	if u, err := lookupUser("4242"); err != nil || u.uid != 4242 || u.gid != 0 || u.home != "/" {
		t.Errorf("lookupUser(4242) = %+v, %v", u, err)
	}
	if _, err := lookupUser("no-such-user-kvbox"); err == nil || !strings.HasPrefix(err.Error(), "user no-such-user-kvbox: no such user") {
		t.Errorf("lookupUser of a missing user: %v", err)
	}
	for dir, want := range map[string]string{
		"/nonexistent-kvbox": "workdir /nonexistent-kvbox: no such directory in the box",
		"/etc/passwd":        "workdir /etc/passwd: not a directory",
	} {
		if err := checkWorkdir(dir); err == nil || err.Error() != want {
			t.Errorf("checkWorkdir(%s) = %v, want %q", dir, err, want)
		}
	}
	if err := checkWorkdir("/tmp"); err != nil {
		t.Error(err)
	}
}
