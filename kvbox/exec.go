package kvbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
)

// WindowSize is a terminal's size, for a command run on one.
type WindowSize = agent.WinSize

// Session is a connection to a box's agent, for commands run in it.
type Session struct{ c *agent.Client }

// Session reaches box name's agent, giving up after Config.DialTimeout: a
// hung agent must not hang the caller. Close it when done.
func (h *Host) Session(ctx context.Context, name string) (*Session, error) {
	_, c, err := h.dialBox(ctx, name)
	if err != nil {
		return nil, err
	}
	return &Session{c: c}, nil
}

// Close ends the session.
func (s *Session) Close() error { return s.c.Close() }

// Exec runs req in the session's box, streaming stdin to it and its output
// to stdout and stderr; resize (nil: none) carries a terminal's new sizes.
// It returns the command's exit code. A command that could not be started,
// was killed at req.Timeout or was refused its user, workdir or
// environment is an error (agent.RemoteError, agent.TimeoutError), as is
// an agent too old for what req asks (--user).
func (s *Session) Exec(ctx context.Context, req agent.ExecRequest, stdin io.Reader, stdout, stderr io.Writer, resize <-chan WindowSize) (int, error) {
	if err := execCompat(ctx, s.c, &req); err != nil {
		return 0, err
	}
	return s.c.Exec(ctx, req, stdin, stdout, stderr, resize)
}

// Exec runs req in box name (Session, then Session.Exec).
func (h *Host) Exec(ctx context.Context, name string, req agent.ExecRequest, stdin io.Reader, stdout, stderr io.Writer, resize <-chan WindowSize) (int, error) {
	s, err := h.Session(ctx, name)
	if err != nil {
		return 0, err
	}
	defer s.Close()
	return s.Exec(ctx, req, stdin, stdout, stderr, resize)
}

// dialBox reaches box name's agent, giving up after Config.DialTimeout.
func (h *Host) dialBox(ctx context.Context, name string) (domain.Box, *agent.Client, error) {
	b, err := h.d.Get(name)
	if err != nil {
		return b, nil, err
	}
	c, err := h.dial(ctx, b)
	return b, c, err
}

// dial reaches box b's agent, giving up after Config.DialTimeout.
func (h *Host) dial(ctx context.Context, b domain.Box) (*agent.Client, error) {
	dctx, cancel := context.WithTimeout(ctx, h.cfg.DialTimeout)
	defer cancel()
	client, err := h.d.Dial(dctx, b)
	if err != nil {
		if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			return nil, base.Errorf(base.Unavailable, "the agent of box %q did not answer within %s (--dial-timeout)", b.Name, h.cfg.DialTimeout)
		}
		return nil, fmt.Errorf("reach the agent of box %q: %w", b.Name, err)
	}
	return client, nil
}

// execCompat makes req work with the agent behind client: an agent that
// predates --user is refused (it would ignore the field and run the
// command as root), and for one that predates --env the variables are sent
// on top of the defaults as a whole environment, which every agent honours.
func execCompat(ctx context.Context, client *agent.Client, req *agent.ExecRequest) error {
	if req.User == "" && len(req.EnvAdd) == 0 {
		return nil
	}
	in, err := client.Ping(ctx)
	if err != nil {
		return err
	}
	if in.Has(agent.FeatureExecUser) {
		return nil
	}
	if req.User != "" {
		return in.Require("--user", agent.FeatureExecUser)
	}
	env := req.Env
	if len(env) == 0 {
		env = agent.DefaultEnv(req.TTY, "")
	}
	req.Env = agent.MergeEnv(env, req.EnvAdd)
	req.EnvAdd = nil
	return nil
}

// ExecFailure is why a command run through Exec did not run to its end.
type ExecFailure int

// The ways a command fails to run to its end (WhyExec).
const (
	// ExecTimedOut: killed, its process group with it, at its timeout.
	ExecTimedOut ExecFailure = iota + 1
	// ExecRefused: its user, workdir or environment cannot be used.
	ExecRefused
	// ExecNotStarted: it could not be started (not found, not
	// executable).
	ExecNotStarted
)

// WhyExec says why err, Exec's error, kept the command from running to
// its end, with the agent's message; 0 for any other error (the box or
// its agent failed).
func WhyExec(err error) (ExecFailure, string) {
	var te *agent.TimeoutError
	if errors.As(err, &te) {
		return ExecTimedOut, te.Error()
	}
	var re *agent.RemoteError
	if !errors.As(err, &re) || re.Method != "exec" {
		return 0, ""
	}
	// The agent's refusals of --user, --workdir and --env start so.
	for _, p := range []string{"user ", "workdir ", "env "} {
		if strings.HasPrefix(re.Message, p) {
			return ExecRefused, re.Message
		}
	}
	return ExecNotStarted, re.Message
}
