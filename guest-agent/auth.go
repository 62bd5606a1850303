package agent

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Peer authentication. The agent serves only the host's kvbox. A
// virtio-serial port is root's on the host (its socket is in the box's
// folder); vsock is not: any local user of the host can connect to a
// guest's port. So the agent has a token, which kvbox gives it over a trusted
// session (set-token) and keeps in the box's folder, root's only; once the
// agent has one, every session on every transport must present it (auth)
// before anything but ping is served. An agent without a token (a box's
// first boot) serves a trusted session at once, and an untrusted one
// nothing. The virtio-serial path, tested here, runs the same check as
// vsock, which these test machines lack.
//
// A session's rights are for the token it presented (or set): setting a
// token ends every other session's rights at once, and such a session is
// served nothing more (a running exec or stream goes on) until it presents
// the new one. A snapshot's token (set-token with snapshot), the one frozen
// into a snapshot's memory and carried with it to other hosts, is taken
// from a trusted session only: whoever holds a copy of the snapshot gets
// nothing over vsock.

const (
	methodAuth     = "auth"
	methodSetToken = "set-token"

	// FeatureAuth: auth and set-token.
	FeatureAuth = "auth"

	// TokenSize is the length of an agent token.
	TokenSize = 32

	tokenFile = "token"
)

func init() {
	registerFeature(FeatureAuth)
	registerOp(methodAuth, beforeAuth, (*session).auth)
	registerOp(methodSetToken, ownCheck, (*session).setToken)
}

// ErrUnauthorized is what an agent answers a session that has not presented
// its token.
var ErrUnauthorized = errors.New("not authorized: this agent serves the host's kvbox only (present its token first)")

type authMsg struct {
	Token []byte `json:"token"`
	// Snapshot (set-token) marks a token minted for a snapshot: served
	// to trusted sessions only.
	Snapshot bool `json:"snapshot,omitempty"`
}

type authReply struct {
	// Provisioned says the agent has a token; without one, kvbox gives it
	// one.
	Provisioned bool `json:"provisioned"`
	// BootID is the guest kernel's boot_id, as Info has it: the answer to
	// auth is all kvbox waits for before a clone's identity (no ping, a
	// round trip of cold guest code less). Older agents leave it out.
	BootID string `json:"boot_id,omitempty"`
}

// tokenState is the agent's token (nil without one), whether it is a
// snapshot's, and its generation, which every set-token bumps; the token
// is read from StateDir on first use. On disk a snapshot's token has one
// byte more (1).
func (s *Server) tokenState() (tok []byte, snapshot bool, gen uint64) {
	s.tokenMu.Lock()
	defer s.tokenMu.Unlock()
	if !s.tokenRead {
		s.tokenRead = true
		if s.StateDir != "" {
			b, err := os.ReadFile(filepath.Join(s.StateDir, tokenFile))
			switch {
			case err != nil:
			case len(b) == TokenSize:
				s.token = b
			case len(b) == TokenSize+1 && b[TokenSize] == 1:
				s.token, s.tokenSnapshot = b[:TokenSize], true
			}
		}
	}
	return s.token, s.tokenSnapshot, s.tokenGen
}

// currentToken is the agent's token, nil when it has none.
func (s *Server) currentToken() []byte {
	tok, _, _ := s.tokenState()
	return tok
}

// setToken replaces the agent's token, on disk first (root's only, and
// synced: the host keeps the new one once the agent answers) when there is
// a StateDir, so a reboot keeps it, and returns its generation.
func (s *Server) setToken(b []byte, snapshot bool) (uint64, error) {
	if len(b) != TokenSize {
		return 0, fmt.Errorf("a token is %d bytes, not %d", TokenSize, len(b))
	}
	s.tokenState() // read before replacing
	if s.StateDir != "" {
		if err := os.MkdirAll(s.StateDir, 0o700); err != nil {
			return 0, err
		}
		onDisk := b
		if snapshot {
			onDisk = append(append([]byte(nil), b...), 1)
		}
		if err := writeFileDurable(filepath.Join(s.StateDir, tokenFile), onDisk, 0o600); err != nil {
			return 0, err
		}
	}
	s.tokenMu.Lock()
	s.token, s.tokenSnapshot = append([]byte(nil), b...), snapshot
	s.tokenGen++
	gen := s.tokenGen
	s.tokenMu.Unlock()
	// A new agent token marks a snapshot about to be copied, its source
	// after the copy, or a clone's first contact: envd's local token is
	// minted again with it (envd.go).
	if err := s.renewEnvdToken(); err != nil {
		s.logf("envd: %v", err)
	}
	return gen, nil
}

// greet starts a session's authorization afresh (at each HELLO).
func (ss *session) greet() { ss.authed = false }

// authorized reports whether the session may be served more than ping:
// it presented (or set) the agent's current token, or the agent has none
// and the session is trusted. A snapshot's token serves trusted sessions
// only.
func (ss *session) authorized() bool {
	tok, snapshot, gen := ss.srv.tokenState()
	switch {
	case tok == nil:
		return ss.trusted
	case snapshot && !ss.trusted:
		return false
	}
	return ss.authed && ss.authGen == gen
}

// auth serves auth: the session presents a token, and is authorized for
// it or refused. Served before authorization (it is how a session gets
// it); it runs on the session's reader goroutine, where ss.authed is kept.
func (ss *session) auth(gen uint64, id uint32, params json.RawMessage) {
	var m authMsg
	if err := json.Unmarshal(params, &m); err != nil {
		ss.reply(gen, id, nil, fmt.Errorf("bad auth: %v", err))
		return
	}
	tok, snapshot, tgen := ss.srv.tokenState()
	switch {
	case tok == nil && ss.trusted:
		ss.authed, ss.authGen = true, tgen
	case tok == nil || subtle.ConstantTimeCompare(tok, m.Token) != 1:
		ss.authed = false
		ss.srv.logf("%s: a peer presented a wrong token", ss.name)
		ss.reply(gen, id, nil, ErrUnauthorized)
		return
	case snapshot && !ss.trusted:
		ss.authed = false
		ss.srv.logf("%s: a snapshot's token was presented on an untrusted transport", ss.name)
		ss.reply(gen, id, nil, ErrUnauthorized)
		return
	default:
		ss.authed, ss.authGen = true, tgen
	}
	// Replied from a goroutine: the requests behind it may be served
	// meanwhile (the reader goes on), and the reply waits for the
	// HELLO's echo.
	go ss.reply(gen, id, authReply{Provisioned: tok != nil, BootID: bootID()}, nil)
}

// setToken serves set-token: it checks the session's authorization itself,
// after its parameters (a malformed request is answered as such on any
// session), and runs on the session's reader goroutine, where ss.authed
// is kept.
func (ss *session) setToken(gen uint64, id uint32, params json.RawMessage) {
	var m authMsg
	err := json.Unmarshal(params, &m)
	switch {
	case err != nil:
		err = fmt.Errorf("bad token: %v", err)
	case !ss.authorized():
		err = ErrUnauthorized
	default:
		var tgen uint64
		if tgen, err = ss.srv.setToken(m.Token, m.Snapshot); err == nil {
			// Its own rights go on with the new token; every other
			// session's end here.
			ss.authed, ss.authGen = true, tgen
		}
	}
	ss.reply(gen, id, nil, err)
}

// ErrNoTokens is what SetToken answers for an agent that predates tokens.
var ErrNoTokens = errors.New("the guest agent predates tokens")

// SetToken makes token the agent's token (with snapshot: a snapshot's,
// served to trusted sessions only) and the one this client presents from
// then on, and asks for the agent's info in the same round trip. Every
// other session of the agent loses its rights at once.
func (c *Client) SetToken(ctx context.Context, token []byte, snapshot bool) (Info, error) {
	var info Info
	errs, err := c.Pipeline(ctx, Call{Method: methodSetToken, Params: authMsg{Token: token, Snapshot: snapshot}},
		Call{Method: methodPing, Result: &info})
	if err != nil {
		return info, err
	}
	var re *RemoteError
	if errors.As(errs[0], &re) && strings.Contains(re.Message, "unknown method") {
		return info, ErrNoTokens
	}
	if errs[0] != nil {
		return info, fmt.Errorf("give the agent its token: %w", errs[0])
	}
	c.Token = token
	if errs[1] != nil {
		return info, fmt.Errorf("ask the agent who it is: %w", errs[1])
	}
	c.infoOnce.Lock()
	c.info = &info
	c.infoOnce.Unlock()
	return info, nil
}
