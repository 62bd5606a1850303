// Package envd serves, inside a box, the contract of envd, the daemon E2B's
// SDKs talk to in a sandbox: the Connect services process.Process and
// filesystem.Filesystem (JSON and binary codecs, over HTTP/1.1), and the
// plain HTTP endpoints GET and POST /files, GET /health and GET /envs. It
// reports Version, and implements what the SDKs send to an envd of that
// version.
//
// The sandbox's own state (environment variables, default user and
// working directory, sandbox and template ids) is not taken over HTTP, as
// E2B's /init does: the host sets it through SetConfig, over the agent
// channel (guest-agent's envd feature).
//
// No secret a client holds is ever in the guest. The host checks the
// sandbox's access token (and /files signatures) before anything crosses
// into the box, and only the host reaches envd through the agent channel,
// so envd trusts those requests (HostHandler). Its other door, the guest's
// loopback listener for the guest's own processes (ServeHTTP), wants the
// local token: a guest-side secret no client sees, which the agent mints
// per box and mints again whenever its own token changes (a snapshot, a
// clone's identity), so a copy found in a clone's memory or disk opens
// nothing.
//
// Processes belong to the Server, not to the request that started them: a
// client that disconnects leaves its process running, to be reattached by
// pid or tag (Connect). A process's life is bounded by the Connect-Timeout-Ms
// of the request that started it, as E2B's envd does.
package envd

import (
	"context"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"kvbox.dev/kvbox/guest-agent/envd/spec/filesystem/filesystemconnect"
	"kvbox.dev/kvbox/guest-agent/envd/spec/process/processconnect"
	"kvbox.dev/kvbox/guest-agent/guestexec"
)

// Version is the envd version reported to the SDKs: they turn features on
// and off by it (0.5.7 octet-stream uploads, 0.6.2 file metadata, 0.6.3
// entries in watch events, 0.6.4 watches of network mounts), so it names
// exactly what this package implements.
const Version = "0.6.4"

// Port is the TCP port of envd in an E2B sandbox; the agent listens on it
// on the guest's loopback only.
const Port = 49983

// Config is the per-sandbox state the host hands over. It holds no
// secret of the sandbox's client: a snapshot copies it into every clone.
type Config struct {
	// EnvVars are added to every process's environment (after PATH,
	// HOME, USER and the E2B_ variables, before the call's own).
	EnvVars map[string]string `json:"env_vars,omitempty"`
	// DefaultUser runs the calls that name no user; root when empty.
	DefaultUser string `json:"default_user,omitempty"`
	// DefaultWorkdir is where a process starts when its call names no
	// directory; the user's home when empty.
	DefaultWorkdir string `json:"default_workdir,omitempty"`
	// SandboxID and TemplateID are given to processes as E2B_SANDBOX_ID
	// and E2B_TEMPLATE_ID.
	SandboxID  string `json:"sandbox_id,omitempty"`
	TemplateID string `json:"template_id,omitempty"`
}

// Validate says in one line what is wrong with c.
func (c Config) Validate() error {
	for k := range c.EnvVars {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return fmt.Errorf("envd: environment variable name %q: not a NAME", k)
		}
	}
	if c.DefaultWorkdir != "" && !filepath.IsAbs(c.DefaultWorkdir) {
		return fmt.Errorf("envd: default workdir %q: not an absolute path", c.DefaultWorkdir)
	}
	return nil
}

// Options configure a Server.
type Options struct {
	// StartProcess, when set, is called with the function that starts
	// each process (exec.Cmd.Start) and runs it: the agent uses it to
	// start processes at its normal priority while it is boosted.
	StartProcess func(start func() error) error
	// Log receives one line per notable event; nil means log.Default().
	Log *log.Logger
}

// Server is one sandbox's envd.
type Server struct {
	opts Options

	cfgMu sync.RWMutex
	cfg   Config
	local string // the loopback listener's token (SetLocalToken)

	procs    processes // process.go
	watchers watchers  // watch.go

	handler http.Handler
}

// New makes an envd with an empty Config (root as the default user) until
// SetConfig, and no local token (its loopback door is shut) until
// SetLocalToken.
func New(o Options) *Server {
	s := &Server{opts: o}
	mux := http.NewServeMux()
	interceptors := connect.WithInterceptors(tokenInterceptor{s})
	path, h := processconnect.NewProcessHandler(&processService{s}, interceptors)
	mux.Handle(path, h)
	path, h = filesystemconnect.NewFilesystemHandler(&filesystemService{s}, interceptors)
	mux.Handle(path, h)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.HandleFunc("GET /envs", s.envs)
	mux.HandleFunc("GET /files", s.getFile)
	mux.HandleFunc("POST /files", s.postFiles)
	s.handler = mux
	return s
}

// ServeHTTP serves the envd contract to the guest's own processes: every
// call but GET /health wants the local token in X-Access-Token (or, for
// /files, a URL signed with it).
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// HostHandler serves the envd contract to the host, which checked the
// caller before the request crossed into the box: no token is asked for.
// Give it only the agent channel's streams.
func (s *Server) HostHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.handler.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), fromHost{}, true)))
	})
}

// fromHost marks a request's context as the host's (HostHandler).
type fromHost struct{}

// SetLocalToken replaces the token the loopback door wants; "" shuts it.
func (s *Server) SetLocalToken(tok string) {
	s.cfgMu.Lock()
	s.local = tok
	s.cfgMu.Unlock()
}

// LocalToken is the token the loopback door wants, "" while it is shut.
func (s *Server) LocalToken() string {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	return s.local
}

// SetConfig replaces the sandbox's state. Processes already running keep
// the environment they started with.
func (s *Server) SetConfig(c Config) error {
	if err := c.Validate(); err != nil {
		return err
	}
	c.EnvVars = maps.Clone(c.EnvVars)
	s.cfgMu.Lock()
	s.cfg = c
	s.cfgMu.Unlock()
	return nil
}

// Config returns the sandbox's state.
func (s *Server) Config() Config {
	s.cfgMu.RLock()
	defer s.cfgMu.RUnlock()
	c := s.cfg
	c.EnvVars = maps.Clone(c.EnvVars)
	return c
}

func (s *Server) logf(format string, args ...any) {
	l := s.opts.Log
	if l == nil {
		l = log.Default()
	}
	l.Printf("envd: "+format, args...)
}

// accessTokenHeader carries the sandbox's access token.
const accessTokenHeader = "X-Access-Token"

// tokenOK reports whether a call may be served: it is the host's, or h
// carries the local token (and there is one).
func (s *Server) tokenOK(ctx context.Context, h http.Header) bool {
	if trusted, _ := ctx.Value(fromHost{}).(bool); trusted {
		return true
	}
	tok := s.LocalToken()
	return tok != "" && subtle.ConstantTimeCompare([]byte(h.Get(accessTokenHeader)), []byte(tok)) == 1
}

var errToken = errors.New("missing or wrong access token (X-Access-Token): envd in the guest wants the box's local token (root's, in the agent's state folder)")

// tokenInterceptor refuses every RPC without the sandbox's token.
type tokenInterceptor struct{ s *Server }

func (ti tokenInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !ti.s.tokenOK(ctx, req.Header()) {
			return nil, connect.NewError(connect.CodeUnauthenticated, errToken)
		}
		return next(ctx, req)
	}
}

func (ti tokenInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (ti tokenInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if !ti.s.tokenOK(ctx, conn.RequestHeader()) {
			return connect.NewError(connect.CodeUnauthenticated, errToken)
		}
		return next(ctx, conn)
	}
}

// userFromHeader is the user a call runs as: the name in its
// "Authorization: Basic base64(name:)" header, else the default user,
// else root.
func (s *Server) userFromHeader(h http.Header) (*guestexec.User, error) {
	name := ""
	if a := h.Get("Authorization"); a != "" {
		scheme, cred, _ := strings.Cut(a, " ")
		if !strings.EqualFold(scheme, "Basic") {
			return nil, fmt.Errorf("authorization: only Basic names a user (got %q)", scheme)
		}
		b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
		if err != nil {
			return nil, fmt.Errorf("authorization: Basic credentials are not base64: %v", err)
		}
		name, _, _ = strings.Cut(string(b), ":")
	}
	return s.lookupUser(name)
}

// lookupUser resolves name, or the default user when it is empty.
func (s *Server) lookupUser(name string) (*guestexec.User, error) {
	if name == "" {
		name = s.Config().DefaultUser
	}
	if name == "" {
		name = "root"
	}
	return guestexec.LookupUser(name)
}

// resolvePath makes p absolute: "~" and "~/x" are the user's home, and a
// relative path is under it.
func resolvePath(p string, u *guestexec.User) (string, error) {
	if p == "" {
		return "", errors.New("no path given")
	}
	switch {
	case p == "~":
		p = u.Home
	case strings.HasPrefix(p, "~/"):
		p = filepath.Join(u.Home, p[2:])
	case !filepath.IsAbs(p):
		p = filepath.Join(u.Home, p)
	}
	return filepath.Clean(p), nil
}

// processEnv is a process's environment: PATH, HOME, USER and LOGNAME of
// u, then E2B_SANDBOX, E2B_SANDBOX_ID and E2B_TEMPLATE_ID, then the
// sandbox's variables, then the call's. A later variable replaces an
// earlier one of the same name in place.
func processEnv(cfg Config, u *guestexec.User, call map[string]string) []string {
	var env []string
	set := func(k, v string) {
		for i, kv := range env {
			if name, _, _ := strings.Cut(kv, "="); name == k {
				env[i] = k + "=" + v
				return
			}
		}
		env = append(env, k+"="+v)
	}
	set("PATH", defaultPath)
	set("HOME", u.Home)
	set("USER", u.Name)
	set("LOGNAME", u.Name)
	set("E2B_SANDBOX", "true")
	if cfg.SandboxID != "" {
		set("E2B_SANDBOX_ID", cfg.SandboxID)
	}
	if cfg.TemplateID != "" {
		set("E2B_TEMPLATE_ID", cfg.TemplateID)
	}
	for _, k := range slices.Sorted(maps.Keys(cfg.EnvVars)) {
		set(k, cfg.EnvVars[k])
	}
	for _, k := range slices.Sorted(maps.Keys(call)) {
		set(k, call[k])
	}
	return env
}

const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// envs answers GET /envs: the sandbox's environment variables.
func (s *Server) envs(w http.ResponseWriter, r *http.Request) {
	if !s.tokenOK(r.Context(), r.Header) {
		httpError(w, http.StatusUnauthorized, errToken.Error())
		return
	}
	vars := s.Config().EnvVars
	if vars == nil {
		vars = map[string]string{}
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(vars)
}

// httpError writes the error body of envd's plain HTTP endpoints.
func httpError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Del("Content-Encoding")
	w.Header().Del("Content-Length")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}{code, msg})
}

// chownTo gives path to u (best effort when the agent is not root).
func chownTo(path string, u *guestexec.User) error {
	if os.Geteuid() != 0 {
		return nil
	}
	return os.Lchown(path, int(u.UID), int(u.GID))
}

// mkdirAllAs makes dir and its missing parents, each new one u's.
func mkdirAllAs(dir string, u *guestexec.User) error {
	var missing []string
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil {
			break
		}
		missing = append(missing, d)
		if d == filepath.Dir(d) {
			break
		}
	}
	for i := len(missing) - 1; i >= 0; i-- {
		if err := os.Mkdir(missing[i], 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
		if err := chownTo(missing[i], u); err != nil {
			return err
		}
	}
	st, err := os.Stat(dir)
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return fmt.Errorf("%s: not a directory", dir)
	}
	return nil
}

// keepaliveHeader names the seconds between keepalive events a streaming
// call asks for when its stream is idle.
const keepaliveHeader = "Keepalive-Ping-Interval"

// defaultKeepalive is the interval without the header.
const defaultKeepalive = 90 * time.Second

func keepaliveInterval(h http.Header) time.Duration {
	var n int
	if _, err := fmt.Sscanf(h.Get(keepaliveHeader), "%d", &n); err == nil && n > 0 {
		return time.Duration(n) * time.Second
	}
	return defaultKeepalive
}
