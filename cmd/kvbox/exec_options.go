package main

import (
	"strings"
	"time"

	"github.com/spf13/cobra"

	agent "kvbox.dev/kvbox/guest-agent"
)

// Exit codes of exec besides the command's own, as timeout(1) and
// docker run use them.
const (
	exitTimedOut = 124 // --timeout passed: the process group was killed
	exitSetup    = 125 // --user or --workdir cannot be used
)

// execOptions are exec's flags beyond -t.
type execOptions struct {
	env     []string
	workdir string
	user    string
	timeout time.Duration
}

func (o *execOptions) flags(c *cobra.Command) {
	f := c.Flags()
	f.StringArrayVarP(&o.env, "env", "e", nil, "set NAME=VALUE in the command's environment, added to the defaults (repeatable)")
	f.StringVarP(&o.workdir, "workdir", "w", "", "working directory in the box (default: the user's HOME, or /)")
	f.StringVarP(&o.user, "user", "u", "", "run as this user (a name or a numeric uid in the box; default root)")
	f.DurationVar(&o.timeout, "timeout", 0, "kill the command's process group after this long (exit 124), e.g. 30s, 5m")
}

// apply checks the flags and puts them in req.
func (o *execOptions) apply(req *agent.ExecRequest) error {
	for _, kv := range o.env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" || strings.ContainsAny(k, " \t\n") {
			return usage("--env %q: want NAME=VALUE", kv)
		}
	}
	if o.timeout < 0 {
		return usage("--timeout %s: must be positive", o.timeout)
	}
	if o.workdir != "" && !strings.HasPrefix(o.workdir, "/") {
		return usage("--workdir %q: must be an absolute path in the box", o.workdir)
	}
	req.EnvAdd, req.Dir, req.User, req.Timeout = o.env, o.workdir, o.user, o.timeout
	return nil
}

func termOr(t string) string {
	if t == "" {
		return "xterm-256color"
	}
	return t
}
