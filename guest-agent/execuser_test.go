package agent

import (
	"slices"
	"testing"

	"kvbox.dev/kvbox/guest-agent/guestexec"
)

// --env adds to the defaults: PATH stays unless it is given.
func TestExecEnvAdd(t *testing.T) {
	for _, tc := range []struct {
		req  ExecRequest
		u    *guestexec.User
		want []string
	}{
		{ExecRequest{EnvAdd: []string{"CI=1"}}, nil,
			[]string{"PATH=" + defaultPath, "HOME=/root", "CI=1"}},
		{ExecRequest{EnvAdd: []string{"PATH=/x", "A="}}, nil,
			[]string{"PATH=/x", "HOME=/root", "A="}},
		{ExecRequest{EnvAdd: []string{"HOME=/h"}}, &guestexec.User{Name: "app", Home: "/home/app"},
			[]string{"PATH=" + defaultPath, "HOME=/h", "USER=app", "LOGNAME=app"}},
		{ExecRequest{Env: []string{"X=1"}, EnvAdd: []string{"X=2", "Y=3"}}, &guestexec.User{Name: "app", Home: "/home/app"},
			[]string{"X=2", "Y=3"}},
	} {
		if got := execEnv(tc.req, tc.u); !slices.Equal(got, tc.want) {
			t.Errorf("execEnv(%+v) = %q, want %q", tc.req, got, tc.want)
		}
	}
}
