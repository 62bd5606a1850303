package agent

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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

const (
	methodAuth     = "auth"
	methodSetToken = "set-token"

	// FeatureAuth: auth and set-token.
	FeatureAuth = "auth"

	// TokenSize is the length of an agent token.
	TokenSize = 32

	tokenFile = "token"
)

func init() { registerFeature(FeatureAuth) }

// ErrUnauthorized is what an agent answers a session that has not presented
// its token.
var ErrUnauthorized = errors.New("not authorized: this agent serves the host's kvbox only (present its token first)")

type authMsg struct {
	Token []byte `json:"token"`
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

// currentToken is the agent's token, read from StateDir on first use; nil
// when it has none.
func (s *Server) currentToken() []byte {
	s.tokenMu.Lock()
	defer s.tokenMu.Unlock()
	if !s.tokenRead {
		s.tokenRead = true
		if s.StateDir != "" {
			if b, err := os.ReadFile(filepath.Join(s.StateDir, tokenFile)); err == nil && len(b) == TokenSize {
				s.token = b
			}
		}
	}
	return s.token
}

// setToken replaces the agent's token, on disk first (root's only) when
// there is a StateDir, so a reboot keeps it.
func (s *Server) setToken(b []byte) error {
	if len(b) != TokenSize {
		return fmt.Errorf("a token is %d bytes, not %d", TokenSize, len(b))
	}
	s.currentToken() // read before replacing
	if s.StateDir != "" {
		if err := os.MkdirAll(s.StateDir, 0o700); err != nil {
			return err
		}
		if err := writeFileAtomic(filepath.Join(s.StateDir, tokenFile), b, 0o600); err != nil {
			return err
		}
	}
	s.tokenMu.Lock()
	s.token = append([]byte(nil), b...)
	s.tokenMu.Unlock()
	return nil
}

// greet starts a session's authorization afresh (at each HELLO).
func (ss *session) greet() {
	ss.authed = ss.trusted && ss.srv.currentToken() == nil
}

// authRequest handles auth and set-token; ok is false for any other
// method. It runs on the session's reader goroutine, as every request's
// authorization check does.
func (ss *session) authRequest(gen uint64, id uint32, req request) (ok bool) {
	switch req.Method {
	case methodAuth:
		var m authMsg
		if err := json.Unmarshal(req.Params, &m); err != nil {
			ss.reply(gen, id, nil, fmt.Errorf("bad auth: %v", err))
			return true
		}
		tok := ss.srv.currentToken()
		switch {
		case tok == nil && ss.trusted:
			ss.authed = true
		case tok == nil || subtle.ConstantTimeCompare(tok, m.Token) != 1:
			ss.authed = false
			ss.srv.logf("%s: a peer presented a wrong token", ss.name)
			ss.reply(gen, id, nil, ErrUnauthorized)
			return true
		default:
			ss.authed = true
		}
		// Replied from a goroutine: the requests behind it may be served
		// meanwhile (the reader goes on), and the reply waits for the
		// HELLO's echo.
		go ss.reply(gen, id, authReply{Provisioned: tok != nil, BootID: bootID()}, nil)
		return true
	case methodSetToken:
		var m authMsg
		err := json.Unmarshal(req.Params, &m)
		switch {
		case err != nil:
			err = fmt.Errorf("bad token: %v", err)
		case !ss.authed:
			err = ErrUnauthorized
		default:
			err = ss.srv.setToken(m.Token)
		}
		ss.reply(gen, id, nil, err)
		return true
	}
	return false
}
