package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/guest-agent/envd"
)

// The envd feature: the agent serves envd, the daemon E2B's SDKs talk to
// in a sandbox (package envd), in-process.
//
// The host reaches it over the agent channel, as a stream to the dial
// address EnvdDialAddress: no guest TCP port is involved, so no process
// in the guest can stand in for it, and envd serves those streams without
// a token (envd.Server.HostHandler): the host checked its caller. For
// callers inside the guest (a code interpreter asking GET /envs) the agent
// also listens on 127.0.0.1:49983, the port E2B's sandboxes have, once the
// host has configured it (EnvdInit). That door wants the box's local
// token: a guest-side secret that no client ever sees, which the agent
// mints itself and keeps in EnvdTokenFile in its state folder (root's
// only, for the guest's own root processes), and mints again whenever the
// agent's own token is set (the token of a snapshot before its memory is
// copied, the source's own again after it, a clone's own at its identity):
// the local token a snapshot's memory or disk holds is dead in every box
// by the time a clone runs.
//
// The configuration (environment variables, default user and workdir,
// sandbox and template ids; no secret of the sandbox's client) comes from
// the host in EnvdInit, typically in a clone's re-identification pipeline
// (EnvdInitCall), and is kept in the agent's state folder (0600), so an
// agent that restarts serves the same sandbox.

// FeatureEnvd: EnvdInit and the dial address EnvdDialAddress.
const FeatureEnvd = "envd"

func init() {
	registerFeature(FeatureEnvd)
	registerOp(methodEnvdInit, authorizedOnly, (*session).envdInit)
}

const methodEnvdInit = "envd-init"

// envdInit configures the agent's envd (Server.EnvdInit) in the background.
func (ss *session) envdInit(gen uint64, id uint32, params json.RawMessage) {
	var cfg envd.Config
	if err := json.Unmarshal(params, &cfg); err != nil {
		ss.reply(gen, id, nil, fmt.Errorf("bad envd configuration: %v", err))
		return
	}
	go func() { ss.reply(gen, id, nil, ss.srv.EnvdInit(cfg)) }()
}

// EnvdDialAddress is the dial address of the agent's own envd: give it to
// Forwarder.Connect for a stream that carries HTTP/1.1 to envd.
const EnvdDialAddress = "envd"

// DefaultEnvdAddr is where envd listens inside the guest once configured.
var DefaultEnvdAddr = fmt.Sprintf("127.0.0.1:%d", envd.Port)

// envdConfigFile holds the configuration in StateDir.
const envdConfigFile = "envd.json"

// EnvdTokenFile holds the box's local envd token in StateDir: hex, root's
// only, overwritten in place at each new one.
const EnvdTokenFile = "envd-token"

// envdState is the agent's envd: made on first use.
type envdState struct {
	once  sync.Once
	srv   *envd.Server
	http  *http.Server  // the host's streams
	local *http.Server  // the guest loopback listener's
	conns chan net.Conn // the host's streams, for http.Serve

	mu        sync.Mutex
	listening net.Listener // the guest loopback listener, once up

	tokenMu sync.Mutex // the local token's file
}

// envdServer returns the agent's envd, serving the host's streams.
func (s *Server) envdServer() *envd.Server {
	e := &s.envd
	e.once.Do(func() {
		e.srv = envd.New(envd.Options{StartProcess: s.boosts.unboosted, Log: s.Log})
		// No read or write timeout: a process's stream lasts as long as
		// the process. Idle keep-alive connections go after a while.
		e.http = &http.Server{Handler: e.srv.HostHandler(), IdleTimeout: 640 * time.Second, ErrorLog: s.Log}
		e.local = &http.Server{Handler: e.srv, IdleTimeout: 640 * time.Second, ErrorLog: s.Log}
		e.conns = make(chan net.Conn)
		go e.http.Serve(chanListener{e.conns})
		s.loadEnvdToken()
	})
	return e.srv
}

// loadEnvdToken gives envd the local token kept in StateDir, or a new one.
func (s *Server) loadEnvdToken() {
	if s.StateDir != "" {
		b, err := os.ReadFile(filepath.Join(s.StateDir, EnvdTokenFile))
		if tok := strings.TrimSpace(string(b)); err == nil && validEnvdToken(tok) {
			s.envd.srv.SetLocalToken(tok)
			return
		}
	}
	if err := s.mintEnvdToken(s.envd.srv); err != nil {
		s.logf("envd: %v", err)
	}
}

// renewEnvdToken mints the box's local envd token: the one before it opens
// nothing from then on. Called whenever the agent's own token is set
// (setToken).
func (s *Server) renewEnvdToken() error { return s.mintEnvdToken(s.envdServer()) }

// mintEnvdToken mints a local token, keeps it in StateDir and gives it to
// srv.
func (s *Server) mintEnvdToken(srv *envd.Server) error {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return fmt.Errorf("mint a local token: %w", err)
	}
	tok := hex.EncodeToString(b)
	e := &s.envd
	e.tokenMu.Lock()
	defer e.tokenMu.Unlock()
	var err error
	if s.StateDir != "" {
		if err = os.MkdirAll(s.StateDir, 0o700); err == nil {
			err = overwriteInPlace(filepath.Join(s.StateDir, EnvdTokenFile), []byte(tok+"\n"), 0o600)
		}
		if err != nil {
			err = fmt.Errorf("keep the local token: %w", err)
		}
	}
	srv.SetLocalToken(tok)
	return err
}

func validEnvdToken(tok string) bool {
	_, err := hex.DecodeString(tok)
	return len(tok) == 64 && err == nil
}

// overwriteInPlace writes data over the file at path (made with perm if
// missing), in its own blocks rather than in a new file renamed over it:
// the secret it held is not left in a freed block of the guest's disk,
// which a snapshot copies whole. What was beyond data's length is zeroed
// and synced before the file is cut to data's length.
func overwriteInPlace(path string, data []byte, perm os.FileMode) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, perm)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a plain file", path)
	}
	if err := f.Chmod(perm); err != nil {
		return err
	}
	buf := data
	if old := fi.Size(); old > int64(len(data)) {
		buf = make([]byte, old)
		copy(buf, data)
	}
	if _, err := f.WriteAt(buf, 0); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if len(buf) != len(data) {
		if err := f.Truncate(int64(len(data))); err != nil {
			return err
		}
		return f.Sync()
	}
	return nil
}

// dialEnvd connects a new stream to the agent's envd: one end of a unix
// socket pair, which half-closes as a TCP connection does, is the
// stream's; envd serves the other.
func (s *Server) dialEnvd() (net.Conn, error) {
	s.envdServer()
	a, b, err := SocketPair()
	if err != nil {
		return nil, fmt.Errorf("envd: %w", err)
	}
	s.envd.conns <- b
	return a, nil
}

// SocketPair is two connected unix stream sockets, which half-close as a
// TCP connection does.
func SocketPair() (net.Conn, net.Conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	var conns []net.Conn
	for _, fd := range fds {
		f := os.NewFile(uintptr(fd), "stream")
		c, cerr := net.FileConn(f) // a dup of fd
		f.Close()
		if cerr != nil {
			err = cerr
			continue
		}
		conns = append(conns, c)
	}
	if err != nil {
		for _, c := range conns {
			c.Close()
		}
		return nil, nil, err
	}
	return conns[0], conns[1], nil
}

// chanListener hands http.Serve the connections sent on it.
type chanListener struct{ c chan net.Conn }

func (l chanListener) Accept() (net.Conn, error) { return <-l.c, nil }
func (l chanListener) Close() error              { return nil }
func (l chanListener) Addr() net.Addr            { return &net.UnixAddr{Name: EnvdDialAddress, Net: "unix"} }

// EnvdInit gives the agent's envd its sandbox's configuration, keeps it in
// StateDir, and starts the guest's loopback listener (EnvdAddr) if it is
// not up yet. The configuration is applied even when the listener cannot
// start (another process holds the port): the error says so, and the host's
// streams are served all the same.
func (s *Server) EnvdInit(cfg envd.Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if s.StateDir != "" {
		b, err := json.Marshal(cfg)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(s.StateDir, 0o700); err != nil {
			return err
		}
		// Root's only: the variables may be secrets. In place, so that a
		// configuration kept by an older agent (which held the client's
		// token) leaves nothing behind.
		if err := overwriteInPlace(filepath.Join(s.StateDir, envdConfigFile), b, 0o600); err != nil {
			return fmt.Errorf("envd: keep the configuration: %w", err)
		}
	}
	if err := s.envdServer().SetConfig(cfg); err != nil {
		return err
	}
	return s.envdListen()
}

// RestoreEnvd applies the configuration an earlier EnvdInit kept, if any
// (an agent that restarted serves the same sandbox); cmd/kvbox-agent calls
// it at start.
func (s *Server) RestoreEnvd() error {
	if s.StateDir == "" {
		return nil
	}
	b, err := os.ReadFile(filepath.Join(s.StateDir, envdConfigFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("envd: %w", err)
	}
	var cfg envd.Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		return fmt.Errorf("envd: %s: %w", envdConfigFile, err)
	}
	if err := s.envdServer().SetConfig(cfg); err != nil {
		return err
	}
	return s.envdListen()
}

// envdListen starts the guest's loopback listener once.
func (s *Server) envdListen() error {
	addr := s.EnvdAddr
	if addr == "" {
		addr = DefaultEnvdAddr
	}
	if addr == "-" {
		return nil
	}
	e := &s.envd
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.listening != nil {
		return nil
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("envd configured, but it cannot listen on %s in the guest (callers inside the box cannot reach it; the host's streams are served): %w", addr, err)
	}
	e.listening = l
	go e.local.Serve(l)
	s.logf("envd listening on %s", l.Addr())
	return nil
}

// EnvdAddrListening is the address of the guest's envd listener, "" while
// there is none.
func (s *Server) EnvdAddrListening() string {
	s.envd.mu.Lock()
	defer s.envd.mu.Unlock()
	if s.envd.listening == nil {
		return ""
	}
	return s.envd.listening.Addr().String()
}

// EnvdInitCall is EnvdInit as a call of a Pipeline (a clone's first
// contact: Reidentify's calls and this one in one round trip).
func EnvdInitCall(cfg envd.Config) Call {
	return Call{Method: methodEnvdInit, Params: cfg}
}

// EnvdInit gives the guest's envd its sandbox's configuration. An agent
// without FeatureEnvd answers with an error naming the unknown method.
func (c *Client) EnvdInit(ctx context.Context, cfg envd.Config) error {
	return c.call(ctx, methodEnvdInit, cfg, nil)
}
