package kvbox

import (
	"errors"
	"fmt"
	"testing"
	"time"

	agent "kvbox.dev/kvbox/guest-agent"
)

// WhyExec tells a command's timeout, the agent's refusal of its user,
// workdir or environment, and a command that could not start apart, and
// from any other failure.
func TestWhyExec(t *testing.T) {
	for _, c := range []struct {
		err  error
		why  ExecFailure
		text string
	}{
		{&agent.TimeoutError{After: time.Second}, ExecTimedOut, "timed out after 1s: the command's process group was killed"},
		{fmt.Errorf("exec: %w", &agent.RemoteError{Method: "exec", Message: "user nobody2: unknown user"}), ExecRefused, "user nobody2: unknown user"},
		{&agent.RemoteError{Method: "exec", Message: "workdir /nope: no such directory"}, ExecRefused, "workdir /nope: no such directory"},
		{&agent.RemoteError{Method: "exec", Message: "env 1X=y: bad name"}, ExecRefused, "env 1X=y: bad name"},
		{&agent.RemoteError{Method: "exec", Message: `exec: "nope": executable file not found in $PATH`}, ExecNotStarted, `exec: "nope": executable file not found in $PATH`},
		{&agent.RemoteError{Method: "ping", Message: "user x"}, 0, ""},
		{errors.New("connection reset"), 0, ""},
		{nil, 0, ""},
	} {
		why, text := WhyExec(c.err)
		if why != c.why || text != c.text {
			t.Errorf("WhyExec(%v) = %d %q, want %d %q", c.err, why, text, c.why, c.text)
		}
	}
}
