// Package serve is `kvbox serve`: E2B's API on one HTTP listener, so that
// agent code written for E2B's SDKs runs unchanged on warm kvbox clones.
//
// The control plane is E2B's REST API (both path generations the SDKs
// use): a template is a kvbox snapshot, a sandbox a warm clone of it whose
// name is the sandbox's id, its timeout the box's TTL, its metadata the
// box's labels. Nothing is kept but in libvirt, through Host, and the
// sandboxes' secrets (access tokens, variables) in serve's own folder,
// root's only: a restarted serve finds every sandbox again, and sandboxes
// run on and expire (their reapers) while it is down.
//
// The data plane routes each request to a sandbox's envd (in the box's
// agent, reached through the agent channel: Host.Dial) or another port of
// the box: by the E2b-Sandbox-Id and E2b-Sandbox-Port headers the SDKs
// send when E2B_SANDBOX_URL is set, by a Host of <port>-<id>.<domain>
// (getHost), or, for /files URLs the SDKs sign, by the signature. Every
// sandbox's access token is checked here before anything reaches its box,
// and the routing headers and the API key are taken off first.
package serve

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"fmt"
	"log"
	"net"
	"net/http"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"kvbox.dev/kvbox/guest-agent/envd"
)

// Config configures a Server.
type Config struct {
	Host Host
	// APIKey is the control plane's key (X-API-Key).
	APIKey string
	// Domain is the sandbox domain the SDKs are given: getHost(port) is
	// <port>-<id>.<Domain>, which the data plane routes by Host.
	Domain string
	// SecretsDir is serve's folder of sandbox secrets (made 0700).
	SecretsDir string
	// MaxClones bounds the clones started at once (0: twice the cores, at
	// least 2); further creates wait their turn.
	MaxClones int
	// PortRequests bounds the requests in flight to one sandbox's ports
	// other than envd's (0: defaultPortRequests); past it serve answers
	// 503 (streams.go).
	PortRequests int
	// Log gets a line per sandbox change and per failure; nil is
	// log.Default().
	Log *log.Logger
}

// Server serves E2B's API over a Host.
type Server struct {
	cfg     Config
	host    Host
	secrets *secrets
	index   *secretIndex // E2B's secrets (e2bsecrets.go)
	clones  chan struct{}

	mu     sync.Mutex
	boxes  map[string]*entry  // sandboxes seen, by id
	locks  map[string]*idLock // lifecycle operations, one at a time per id
	closed bool
}

// idLock is one sandbox's lock, and how many hold or wait for it.
type idLock struct {
	mu sync.Mutex
	n  int
}

// entry is a sandbox's box as last seen, and the HTTP transports of its
// streams (streams.go). A proxied request that fails makes serve read the
// box again.
type entry struct {
	box Box
	tr  *boxStreams
}

// New opens serve's folder and prunes the secrets of sandboxes whose box is
// gone (removed by a TTL, or kvbox rm, while serve was down).
func New(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.Host == nil || cfg.APIKey == "" || cfg.SecretsDir == "" || cfg.Domain == "" {
		return nil, fmt.Errorf("serve: Host, APIKey, Domain and SecretsDir are required")
	}
	if cfg.MaxClones <= 0 {
		cfg.MaxClones = max(2, 2*runtime.NumCPU())
	}
	if cfg.PortRequests <= 0 {
		cfg.PortRequests = defaultPortRequests
	}
	if cfg.Log == nil {
		cfg.Log = log.Default()
	}
	sec, err := openSecrets(cfg.SecretsDir)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, host: cfg.Host, secrets: sec, index: &secretIndex{path: filepath.Join(cfg.SecretsDir, "e2b-secrets", "index.json")},
		clones: make(chan struct{}, cfg.MaxClones),
		boxes:  map[string]*entry{}, locks: map[string]*idLock{}}
	if err := s.start0(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// start0 is what a serve does first: it prunes the secrets of sandboxes
// whose box is gone, and gives a running sandbox without a deadline (a
// serve that died in a pause, between taking the deadline away and the
// suspend) its timeout again, and takes a paused label off a running box.
func (s *Server) start0(ctx context.Context) error {
	boxes, err := s.host.Boxes(ctx)
	if err != nil {
		return fmt.Errorf("serve: list boxes: %w", err)
	}
	have := map[string]bool{}
	for _, b := range boxes {
		if !isSandbox(b) {
			continue
		}
		have[b.Name] = true
		if b.State == Running && b.Labels[labelPaused] != "" {
			// A serve died in a pause without memory before the box went
			// down, or in its boot after it came up: it runs.
			if nb, err := s.host.SetLabels(ctx, b.Name, withLabel(b.Labels, labelPaused, "")); err != nil {
				s.logf("sandbox %s runs with a paused label that could not be taken away: %v", b.Name, err)
			} else {
				b = nb
			}
		}
		if b.State == Running && b.Expires == nil {
			at := time.Now().Add(timeoutOf(b, defaultTimeout))
			if _, err := s.host.SetExpires(ctx, b.Name, &at); err != nil {
				s.logf("sandbox %s runs without a deadline and could not get one: %v", b.Name, err)
			} else {
				s.logf("sandbox %s ran without a deadline (a serve died while pausing it): it times out at %s", b.Name, at.Format(time.RFC3339))
			}
		}
	}
	return s.forget(have)
}

// prune forgets the secrets of sandboxes that have no box any more.
func (s *Server) prune(ctx context.Context) error {
	boxes, err := s.host.Boxes(ctx)
	if err != nil {
		return fmt.Errorf("serve: list boxes: %w", err)
	}
	have := map[string]bool{}
	for _, b := range boxes {
		if isSandbox(b) {
			have[b.Name] = true
		}
	}
	return s.forget(have)
}

// forget prunes the secrets of the sandboxes not in have (nor being made).
func (s *Server) forget(have map[string]bool) error {
	s.mu.Lock()
	for id := range s.locks {
		have[id] = true // being made or changed now
	}
	s.mu.Unlock()
	for _, rec := range s.secrets.prune(func(id string) bool { return have[id] }) {
		s.dropSecrets(rec.HeaderSecrets, nil)
		s.logf("sandbox %s is gone (its TTL, or kvbox rm): its secrets are removed", rec.ID)
	}
	return nil
}

// Prune runs prune every interval until ctx ends: a sandbox a reaper
// removed while serve runs leaves no token behind for long.
func (s *Server) Prune(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := s.prune(ctx); err != nil {
				s.logf("%v", err)
			}
			s.dropGone(ctx)
		}
	}
}

// forgetRecord forgets a sandbox's record and removes its own header
// secrets from the host's store.
func (s *Server) forgetRecord(rec record) {
	s.secrets.del(rec.ID)
	s.dropSecrets(rec.HeaderSecrets, nil)
}

// Close drops every box's idle streams.
func (s *Server) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for id, e := range s.boxes {
		e.tr.CloseIdleConnections()
		delete(s.boxes, id)
	}
}

func (s *Server) logf(format string, a ...any) { s.cfg.Log.Printf(format, a...) }

// Routing headers the SDKs send with every data-plane request when
// E2B_SANDBOX_URL is set (SDK 2.7.0 on; on /files from JS 2.14.1 on).
const (
	hdrSandboxID   = "E2b-Sandbox-Id"
	hdrSandboxPort = "E2b-Sandbox-Port"
	hdrAPIKey      = "X-Api-Key"
	hdrAccessToken = "X-Access-Token"
	hdrTraffic     = "E2b-Traffic-Access-Token"
)

// ServeHTTP sends each request to the data plane or the control plane.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if id := r.Header.Get(hdrSandboxID); id != "" {
		port := envd.Port
		if p := r.Header.Get(hdrSandboxPort); p != "" {
			n, err := strconv.Atoi(p)
			if err != nil || n < 1 || n > 65535 {
				writeError(w, http.StatusBadRequest, "%s %q is not a port", hdrSandboxPort, p)
				return
			}
			port = n
		}
		s.data(w, r, id, port)
		return
	}
	if id, port, ok := s.hostRoute(r.Host); ok {
		s.data(w, r, id, port)
		return
	}
	if r.URL.Path == "/files" && (r.Method == http.MethodGet || r.Method == http.MethodPost) {
		// A signed URL (downloadUrl, uploadUrl) names no sandbox, and SDKs
		// before JS 2.14.1 sent no routing headers on /files: the
		// signature or the access token tells the sandbox.
		if id, ok, tried := s.filesOwner(r); tried {
			if !ok && s.expiredSignature(r) {
				writeError(w, http.StatusUnauthorized, "%s", expiredMsg)
				return
			}
			if !ok {
				writeError(w, http.StatusUnauthorized, "the signature or access token of this /files request is no sandbox's")
				return
			}
			s.data(w, r, id, envd.Port)
			return
		}
	}
	s.control(w, r)
}

// hostRoute reads a Host of <port>-<id>.<domain> (getHost's), with or
// without the listener's port.
func (s *Server) hostRoute(host string) (id string, port int, ok bool) {
	h := stripPort(strings.ToLower(host))
	dom := stripPort(strings.ToLower(s.cfg.Domain))
	label, found := strings.CutSuffix(h, "."+dom)
	if !found {
		return "", 0, false
	}
	p, id, found := strings.Cut(label, "-")
	if !found || !validID(id) {
		return "", 0, false
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 {
		return "", 0, false
	}
	return id, n, true
}

func stripPort(h string) string {
	if host, _, err := net.SplitHostPort(h); err == nil {
		return host
	}
	return h
}

// filesOwner finds the sandbox a header-less /files request is for: the one
// whose token signs it, or whose token it carries. tried is false when it
// has neither.
func (s *Server) filesOwner(r *http.Request) (id string, ok, tried bool) {
	q := r.URL.Query()
	sig, tok := q.Get("signature"), r.Header.Get(hdrAccessToken)
	if sig == "" && tok == "" {
		return "", false, false
	}
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	for _, rec := range s.secrets.all() {
		if tok != "" && subtle.ConstantTimeCompare([]byte(tok), []byte(rec.AccessToken)) == 1 {
			return rec.ID, true, true
		}
		if sig != "" && signatureOK(r, op, rec.AccessToken) == "" {
			return rec.ID, true, true
		}
	}
	return "", false, true
}

// signatureOK says why a /files request's signature does not authorize op
// with token ("" when it does), as envd checks it.
func signatureOK(r *http.Request, op, token string) string {
	q := r.URL.Query()
	sig := q.Get("signature")
	if sig == "" {
		return "no signature"
	}
	var exp int64
	if e := q.Get("signature_expiration"); e != "" {
		var err error
		if exp, err = strconv.ParseInt(e, 10, 64); err != nil {
			return "signature_expiration is not a Unix time"
		}
		if time.Now().Unix() > exp {
			return expiredMsg
		}
	}
	want := envd.Signature(q.Get("path"), op, q.Get("username"), token, exp)
	if subtle.ConstantTimeCompare([]byte(sig), []byte(want)) != 1 {
		return "the signature does not match"
	}
	return ""
}

// Sandbox ids are E2B's shape: 20 characters of [a-z0-9]. The id is the
// box's name, and its hostname; no '-', so a Host of <port>-<id> splits at
// the first one.
const idLen = 20

func newID() string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, idLen)
	rand.Read(b)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b)
}

// validID is an id serve could have made (any length: ids of other shapes
// are only never found).
func validID(id string) bool {
	if id == "" || len(id) > 63 {
		return false
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// newToken is a sandbox's access token: 32 random bytes, hex.
func newToken() string {
	b := make([]byte, 32)
	rand.Read(b)
	return fmt.Sprintf("%x", b)
}

// opLock serializes the lifecycle operations of one sandbox (create, kill,
// pause, connect, timeout, fork); the returned func unlocks. While it is
// held the sandbox's secrets are not pruned.
func (s *Server) opLock(id string) func() {
	s.mu.Lock()
	l := s.locks[id]
	if l == nil {
		l = &idLock{}
		s.locks[id] = l
	}
	l.n++
	s.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		s.mu.Lock()
		if l.n--; l.n == 0 {
			delete(s.locks, id)
		}
		s.mu.Unlock()
	}
}
