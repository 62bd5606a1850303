package serve

import (
	"cmp"
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/guest-agent/envd"
)

// control serves E2B's REST API: /health without a key, the rest with it.
func (s *Server) control(w http.ResponseWriter, r *http.Request) {
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	if r.URL.Path == "/health" {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			writeError(w, http.StatusMethodNotAllowed, "%s /health: only GET", r.Method)
			return
		}
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if !s.apiKeyOK(r) {
		writeError(w, http.StatusUnauthorized, "missing or wrong API key (X-API-Key): kvbox serve key prints it")
		return
	}
	if parts[0] == "v2" {
		parts = parts[1:]
	}
	method := func(allowed ...string) bool {
		if slices.Contains(allowed, r.Method) {
			return true
		}
		writeError(w, http.StatusMethodNotAllowed, "%s %s: this path takes %s", r.Method, r.URL.Path, strings.Join(allowed, ", "))
		return false
	}
	switch {
	case len(parts) == 1 && parts[0] == "sandboxes":
		if !method(http.MethodPost, http.MethodGet) {
			return
		}
		if r.Method == http.MethodPost {
			s.create(w, r)
		} else {
			s.list(w, r, strings.HasPrefix(r.URL.Path, "/v2/"))
		}
	case len(parts) == 2 && parts[0] == "sandboxes":
		if !method(http.MethodGet, http.MethodDelete) {
			return
		}
		if r.Method == http.MethodGet {
			s.detail(w, r, parts[1])
		} else {
			s.kill(w, r, parts[1])
		}
	case len(parts) == 3 && parts[0] == "sandboxes":
		s.sandboxCall(w, r, parts[1], parts[2], method)
	case len(parts) == 1 && parts[0] == "snapshots":
		if method(http.MethodGet) {
			s.listSnapshots(w, r)
		}
	case (len(parts) == 1 || len(parts) == 2) && parts[0] == "secrets":
		s.secretsCall(w, r, parts, method)
	case len(parts) == 2 && parts[0] == "templates":
		if method(http.MethodDelete) {
			s.deleteTemplate(w, r, parts[1])
		}
	default:
		writeError(w, http.StatusNotFound, "%s %s: kvbox serve has no such call (docs/e2b.md lists what it serves)", r.Method, r.URL.Path)
	}
}

// sandboxCall serves POST /sandboxes/{id}/CALL (and GET/PUT of the calls
// kvbox serve does not implement).
func (s *Server) sandboxCall(w http.ResponseWriter, r *http.Request, id, call string, method func(...string) bool) {
	calls := map[string]func(http.ResponseWriter, *http.Request, string) error{
		"timeout": s.setTimeout, "refreshes": s.refresh, "connect": s.connect, "resume": s.resume,
		"pause": s.pause, "fork": s.fork, "snapshots": s.createSnapshot,
	}
	if f := calls[call]; f != nil {
		if method(http.MethodPost) {
			if err := f(w, r, id); err != nil {
				s.fail(w, r, err)
			}
		}
		return
	}
	switch call {
	case "network":
		if method(http.MethodPut) {
			if err := s.updateNetwork(w, r, id); err != nil {
				s.fail(w, r, err)
			}
		}
		return
	case "metrics", "logs", "cpus":
		writeError(w, http.StatusNotImplemented, "%s %s: kvbox serve does not implement sandbox %s", r.Method, r.URL.Path, call)
	default:
		writeError(w, http.StatusNotFound, "%s %s: kvbox serve has no such call", r.Method, r.URL.Path)
	}
}

func (s *Server) apiKeyOK(r *http.Request) bool {
	k := r.Header.Get(hdrAPIKey)
	return k != "" && subtle.ConstantTimeCompare([]byte(k), []byte(s.cfg.APIKey)) == 1
}

// fail answers err: an apiError with its status, a Host error by its kind.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, err error) {
	var ae *apiError
	if errors.As(err, &ae) {
		writeError(w, ae.status, "%s", ae.msg)
		return
	}
	status := http.StatusInternalServerError
	switch {
	case errors.Is(err, ErrNotFound), errors.Is(err, errGone):
		status = http.StatusNotFound
	case errors.Is(err, ErrExists), errors.Is(err, ErrBusy):
		status = http.StatusConflict
	case errors.Is(err, ErrInvalid):
		status = http.StatusBadRequest
	case r.Context().Err() != nil:
		return // the client is gone
	}
	if status == http.StatusInternalServerError {
		s.logf("%s %s: %v", r.Method, r.URL.Path, err)
	}
	writeError(w, status, "%s", err)
}

// templateRe is a kvbox snapshot name.
var templateRe = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}$`)

// templateName is the snapshot a templateID names: E2B's "team/name:tag"
// forms name the snapshot "name".
func templateName(t string) (string, error) {
	name := t
	if i := strings.LastIndexByte(name, '/'); i >= 0 {
		name = name[i+1:]
	}
	if i := strings.IndexByte(name, ':'); i >= 0 {
		name = name[:i]
	}
	if t == "" {
		return "", errorf(http.StatusBadRequest, "templateID is required: a kvbox snapshot's name (kvbox snapshots ls)")
	}
	if !templateRe.MatchString(name) || strings.Contains(name, "..") {
		return "", errorf(http.StatusBadRequest, "templateID %q names no kvbox snapshot: a snapshot's name has letters, digits, '-', '_' and '.'", t)
	}
	return name, nil
}

// maxTimeout bounds a timeout in seconds (ten years: no deadline overflows).
const maxTimeout = 10 * 365 * 24 * 3600

// seconds reads a timeout field: def when absent, else 1..maxTimeout.
func seconds(field string, v *int64, def time.Duration) (time.Duration, error) {
	if v == nil {
		return def, nil
	}
	if *v < 1 || *v > maxTimeout {
		return 0, errorf(http.StatusBadRequest, "%s %d: give seconds, 1 to %d", field, *v, maxTimeout)
	}
	return time.Duration(*v) * time.Second, nil
}

// defaultTimeout is a sandbox's when create names none (the spec's).
const defaultTimeout = 15 * time.Second

// checkText refuses what the box's labels could not keep as given.
func checkText(what, s string, key bool) error {
	if key && s == "" {
		return errorf(http.StatusBadRequest, "%s: an empty key", what)
	}
	if !utf8.ValidString(s) {
		return errorf(http.StatusBadRequest, "%s %q: not UTF-8", what, s)
	}
	for _, r := range s {
		if r < 0x20 && (key || r != '\t' && r != '\n') || r == 0x7f || r == 0xFFFE || r == 0xFFFF {
			return errorf(http.StatusBadRequest, "%s %q: control characters", what, s)
		}
	}
	return nil
}

// create serves POST /sandboxes and /v2/sandboxes: a warm clone of the
// template, answered once its envd serves it.
func (s *Server) create(w http.ResponseWriter, r *http.Request) {
	var req newSandboxJSON
	if e := decodeBody(w, r, &req, false); e != nil {
		s.fail(w, r, e)
		return
	}
	snap, err := templateName(req.TemplateID)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	timeout, err := seconds("timeout", req.Timeout, defaultTimeout)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if err := refuseUnsupported(req); err != nil {
		s.fail(w, r, err)
		return
	}
	labels := map[string]string{labelTemplate: req.TemplateID, labelTimeout: strconv.FormatInt(int64(timeout/time.Second), 10)}
	for k, v := range req.Metadata {
		if err := errors.Join(checkText("metadata key", k, true), checkText("metadata value", v, false)); err != nil {
			s.fail(w, r, err)
			return
		}
		labels[labelMetadata+k] = v
	}
	if req.AutoResume != nil && req.AutoResume.Enabled {
		labels[labelAutoResume] = "true"
	}
	cfg := envd.Config{EnvVars: req.EnvVars}
	if err := cfg.Validate(); err != nil {
		s.fail(w, r, errorf(http.StatusBadRequest, "envVars: %v", err))
		return
	}
	rec := record{ID: newID(), AccessToken: newToken(), EnvVars: req.EnvVars}
	if n := req.Network; n != nil && n.AllowPublicTraffic != nil && !*n.AllowPublicTraffic {
		rec.TrafficToken = newToken()
	}
	how := startHow{noInternet: req.AllowInternetAccess != nil && !*req.AllowInternetAccess,
		pauseAtTimeout: req.AutoPause != nil && *req.AutoPause}
	if n := req.Network; n != nil {
		nj := networkJSON{AllowOut: n.AllowOut, DenyOut: n.DenyOut, Rules: n.Rules, EgressProxy: n.EgressProxy}
		pl, err := s.plan(nj, how.noInternet, tenantOf(r), rec.ID)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		how.egress, how.headerSecrets = pl.policy, pl.secrets
		rec.Egress, rec.HeaderSecrets = pl.policy, pl.secrets
		if how.egress != nil {
			// The policy's deny-all is the sandbox's way out, not none.
			how.noInternet = false
		}
	}
	t0 := time.Now()
	b, err := s.start(r.Context(), snap, labels, rec, timeout, how)
	if errors.Is(err, ErrNotFound) {
		err = errorf(http.StatusNotFound, "template %q not found: a template is a kvbox snapshot (kvbox snapshots ls lists them; kvbox snapshots new BOX NAME makes one)", req.TemplateID)
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	s.logf("sandbox %s created from template %s in %.2fs (timeout %s)", b.Name, snap, time.Since(t0).Seconds(), timeout)
	writeJSON(w, http.StatusCreated, s.sandboxJSON(b, rec))
}

// refuseUnsupported names, in one line, what a create asks that kvbox
// serve cannot give: better refused than quietly not done.
func refuseUnsupported(req newSandboxJSON) error {
	switch {
	case len(req.VolumeMounts) > 0:
		return errorf(http.StatusBadRequest, "volumeMounts: kvbox serve has no volumes")
	case len(req.MCP) > 0 && string(req.MCP) != "null":
		return errorf(http.StatusBadRequest, "mcp: kvbox serve starts no MCP gateway")
	case len(req.IAM) > 0 && string(req.IAM) != "null":
		return errorf(http.StatusBadRequest, "iam: kvbox serve issues no IAM tokens")
	case req.AutoPauseMemory != nil && !*req.AutoPauseMemory:
		return errorf(http.StatusBadRequest, "autoPauseMemory false (onTimeout keepMemory false): kvbox serve's pause at the timeout keeps the memory; pause with keepMemory false pauses without it")
	}
	return nil
}

// startHow is what a sandbox is started with besides its template,
// labels, secrets and timeout.
type startHow struct {
	noInternet     bool // allow_internet_access false, with no rules
	pauseAtTimeout bool // lifecycle onTimeout pause (autoPause)
	// egress is the policy of network.allowOut, denyOut and rules (nil:
	// none, or its snapshot's); headerSecrets the values of the sandbox's
	// own header secrets it names, put in the host's store before the
	// clone.
	egress        *egress.Policy
	headerSecrets map[string]string
}

// start clones a sandbox: its secrets kept first (a serve that dies
// meanwhile leaves a record without a box, which the next prune takes),
// then the clone with its envd configured in the same round trip as its
// identity.
func (s *Server) start(ctx context.Context, snap string, labels map[string]string, rec record, timeout time.Duration, how startHow) (Box, error) {
	unlock := s.opLock(rec.ID)
	defer unlock()
	if err := s.secrets.put(rec); err != nil {
		return Box{}, err
	}
	if err := s.putSecrets(how.headerSecrets); err != nil {
		s.secrets.del(rec.ID)
		return Box{}, err
	}
	select {
	case s.clones <- struct{}{}:
	case <-ctx.Done():
		s.forgetRecord(rec)
		return Box{}, ctx.Err()
	}
	defer func() { <-s.clones }()
	// The timeout counts from when the sandbox is ready, as E2B's does:
	// the clone's reaper waits out the clone itself too (a timeout shorter
	// than a clone on a busy host would stop the box while it boots), and
	// the deadline is set once the sandbox serves.
	at := time.Now().Add(timeout + cloneGrace)
	// No token: the client's stays on the host (serve checks it), since
	// whatever the guest holds, every snapshot and fork of it carries.
	cfg := &envd.Config{EnvVars: rec.EnvVars, DefaultUser: defaultUser, SandboxID: rec.ID, TemplateID: snap}
	if _, err := s.host.Clone(ctx, CloneRequest{Snapshot: snap, Name: rec.ID, Expires: &at, Labels: labels, Envd: cfg,
		NoInternet: how.noInternet, SuspendAtExpiry: how.pauseAtTimeout, Egress: how.egress}); err != nil {
		s.forgetRecord(rec)
		return Box{}, err
	}
	ready := time.Now().Add(timeout)
	nb, err := s.host.SetExpires(ctx, rec.ID, &ready)
	if err != nil {
		if rerr := s.host.Remove(context.WithoutCancel(ctx), rec.ID); rerr != nil {
			s.logf("sandbox %s: its deadline could not be set, nor the box removed: %v", rec.ID, rerr)
		}
		s.forgetRecord(rec)
		return Box{}, fmt.Errorf("sandbox %s: set its timeout: %w", rec.ID, err)
	}
	s.keep(nb)
	return nb, nil
}

// cloneGrace is how much longer than its timeout a sandbox's box may live
// while it is cloned: a clone's bound, and a box a serve killed in the
// middle of a create outlives the create by no more.
const cloneGrace = 10 * time.Minute

// defaultUser runs what a call names no user for: E2B's templates have the
// user "user" (uid 1000, /home/user), and code written for them assumes it.
const defaultUser = "user"

// list serves GET /v2/sandboxes (filters, pages) and GET /sandboxes (the
// running ones).
func (s *Server) list(w http.ResponseWriter, r *http.Request, v2 bool) {
	q := r.URL.Query()
	meta, err := metadataQuery(q.Get("metadata"))
	if err != nil {
		s.fail(w, r, err)
		return
	}
	states := map[string]bool{"running": true, "paused": true}
	if !v2 {
		states = map[string]bool{"running": true}
	}
	if v, ok := q["state"]; ok {
		states = map[string]bool{}
		for _, x := range v {
			for _, st := range strings.Split(x, ",") {
				if st != "running" && st != "paused" {
					s.fail(w, r, errorf(http.StatusBadRequest, "state %q: give running or paused", st))
					return
				}
				states[st] = true
			}
		}
	}
	var after time.Time
	if v := q.Get("startedAfter"); v != "" {
		if after, err = time.Parse(time.RFC3339, v); err != nil {
			s.fail(w, r, errorf(http.StatusBadRequest, "startedAfter %q: not an RFC 3339 time", v))
			return
		}
	}
	template := q.Get("template")
	boxes, err := s.host.Boxes(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	var out []listedJSON
	running := 0
	for _, b := range boxes {
		if !isSandbox(b) || b.State == Stopped && !diskPaused(b) {
			continue
		}
		if b.State == Running {
			running++
		}
		l := listedOf(b)
		switch {
		// startedAfter is inclusive (E2B's >=): a sandbox started at that
		// very time is listed.
		case !states[l.State], !after.IsZero() && l.StartedAt.Before(after),
			template != "" && template != l.TemplateID && template != l.Alias:
			continue
		}
		if !matches(l.Metadata, meta) {
			continue
		}
		out = append(out, l)
	}
	desc := q.Get("order") != "asc"
	slices.SortFunc(out, func(a, b listedJSON) int {
		c := cmp.Or(a.StartedAt.Compare(b.StartedAt), strings.Compare(a.SandboxID, b.SandboxID))
		if desc {
			return -c
		}
		return c
	})
	if !v2 {
		writeJSON(w, http.StatusOK, nonNil(out))
		return
	}
	page, next, err := paginate(out, q, desc, func(l listedJSON) string { return pageKey(l.StartedAt, l.SandboxID) })
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	w.Header().Set("X-Total-Running", strconv.Itoa(running))
	writeJSON(w, http.StatusOK, nonNil(page))
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// metadataQuery reads the metadata filter: a query string of key=value
// pairs ("a=1&b=2"), each key and value escaped once more by the SDKs.
func metadataQuery(v string) (map[string]string, error) {
	if v == "" {
		return nil, nil
	}
	pairs, err := url.ParseQuery(v)
	if err != nil {
		return nil, errorf(http.StatusBadRequest, "metadata %q: not key=value pairs: %v", v, err)
	}
	m := map[string]string{}
	for k, vs := range pairs {
		if uk, err := url.QueryUnescape(k); err == nil {
			k = uk
		}
		val := vs[len(vs)-1]
		if uv, err := url.QueryUnescape(val); err == nil {
			val = uv
		}
		m[k] = val
	}
	return m, nil
}

func matches(have, want map[string]string) bool {
	for k, v := range want {
		if got, ok := have[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// pageKey is where a page of a sorted listing starts: fixed width, so that
// keys sort as the listing does.
func pageKey(t time.Time, id string) string {
	return fmt.Sprintf("%020d.%s", t.UnixNano(), id)
}

// maxPage is the most a page holds (and what one holds by default).
const maxPage = 100

// paginate cuts items (sorted by key, descending with desc) at nextToken,
// to limit items; next is the token of the page after, "" when this is the
// last. A token whose item is gone starts the page where it stood.
func paginate[T any](items []T, q url.Values, desc bool, key func(T) string) (page []T, next string, err error) {
	limit := maxPage
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxPage {
			return nil, "", errorf(http.StatusBadRequest, "limit %q: give 1 to %d", v, maxPage)
		}
		limit = n
	}
	start := 0
	if tok := q.Get("nextToken"); tok != "" {
		if _, id, ok := strings.Cut(tok, "."); !ok || id == "" {
			return nil, "", errorf(http.StatusBadRequest, "nextToken %q is not one kvbox serve gave", tok)
		}
		start = len(items)
		for i, it := range items {
			if k := key(it); k == tok || desc && k < tok || !desc && k > tok {
				start = i
				break
			}
		}
	}
	end := min(start+limit, len(items))
	if end < len(items) {
		next = key(items[end])
	}
	return items[start:end], next, nil
}

// sandbox reads a sandbox for a control-plane call: ErrNotFound (404) when
// there is none, or its box is stopped.
func (s *Server) sandbox(ctx context.Context, id string) (Box, record, error) {
	b, err := s.lookup(ctx, id)
	if errors.Is(err, errGone) {
		if b.Name != "" {
			return b, record{}, errorf(http.StatusNotFound, "sandbox %s is not running: its box is stopped (kvbox start %s, or kill it)", id, id)
		}
		return Box{}, record{}, errorf(http.StatusNotFound, "sandbox %s not found", id)
	}
	if err != nil {
		return Box{}, record{}, err
	}
	rec, _ := s.secrets.get(id)
	return b, rec, nil
}

// detail serves GET /sandboxes/{id}.
func (s *Server) detail(w http.ResponseWriter, r *http.Request, id string) {
	b, rec, err := s.sandbox(r.Context(), id)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s.detailOf(b, rec))
}

// kill serves DELETE /sandboxes/{id}: kvbox rm --force, whatever its state.
func (s *Server) kill(w http.ResponseWriter, r *http.Request, id string) {
	unlock := s.opLock(id)
	defer unlock()
	b, err := s.lookup(r.Context(), id)
	switch {
	case errors.Is(err, errGone) && b.Name == "":
		s.fail(w, r, errorf(http.StatusNotFound, "sandbox %s not found", id))
		return
	case err != nil && !errors.Is(err, errGone):
		s.fail(w, r, err)
		return
	}
	if err := s.host.Remove(r.Context(), id); err != nil && !errors.Is(err, ErrNotFound) {
		s.fail(w, r, err)
		return
	}
	s.drop(id)
	rec, _ := s.secrets.get(id)
	rec.ID = id
	s.forgetRecord(rec)
	s.logf("sandbox %s killed", id)
	w.WriteHeader(http.StatusNoContent)
}

// locked takes sandbox id's lock and looks the sandbox up. The caller
// releases the lock (unlock) unless err, when it is released already.
func (s *Server) locked(ctx context.Context, id string) (b Box, rec record, unlock func(), err error) {
	unlock = s.opLock(id)
	if b, rec, err = s.sandbox(ctx, id); err != nil {
		unlock()
		return Box{}, record{}, nil, err
	}
	return b, rec, unlock, nil
}

// withSandbox runs f on sandbox id, looked up under its lock.
func (s *Server) withSandbox(ctx context.Context, id string, f func(Box, record) error) error {
	b, rec, unlock, err := s.locked(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	return f(b, rec)
}

// setTimeout serves POST /sandboxes/{id}/timeout: the deadline is now plus
// the timeout, earlier or later than it was.
func (s *Server) setTimeout(w http.ResponseWriter, r *http.Request, id string) error {
	var req timeoutJSON
	if e := decodeBody(w, r, &req, false); e != nil {
		return e
	}
	if req.Timeout == nil {
		return errorf(http.StatusBadRequest, "timeout is required (seconds)")
	}
	d, err := seconds("timeout", req.Timeout, 0)
	if err != nil {
		return err
	}
	return s.withSandbox(r.Context(), id, func(b Box, _ record) error {
		if isPaused(b) {
			return errorf(http.StatusConflict, "sandbox %s is paused and has no timeout: connect resumes it with one", id)
		}
		at := time.Now().Add(d)
		if _, err := s.host.SetExpires(r.Context(), id, &at); err != nil {
			return err
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

// refresh serves POST /sandboxes/{id}/refreshes: the deadline moves to now
// plus the duration, never earlier.
func (s *Server) refresh(w http.ResponseWriter, r *http.Request, id string) error {
	var req durationJSON
	if e := decodeBody(w, r, &req, true); e != nil {
		return e
	}
	d, err := seconds("duration", req.Duration, defaultTimeout)
	if err != nil {
		return err
	}
	return s.withSandbox(r.Context(), id, func(b Box, _ record) error {
		if b.State == Running {
			if err := s.extend(r.Context(), b, d); err != nil {
				return err
			}
		}
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

// extend moves a running sandbox's deadline to now+d unless it is later.
func (s *Server) extend(ctx context.Context, b Box, d time.Duration) error {
	at := time.Now().Add(d)
	if b.Expires != nil && b.Expires.After(at) {
		return nil
	}
	nb, err := s.host.SetExpires(ctx, b.Name, &at)
	if err == nil {
		s.keep(nb)
	}
	return err
}

// connect serves POST /sandboxes/{id}/connect (and /v2/): a running
// sandbox's deadline is extended (never shortened), 200; a paused one is
// resumed with a deadline of now plus the timeout, 201.
func (s *Server) connect(w http.ResponseWriter, r *http.Request, id string) error {
	var req timeoutJSON
	if e := decodeBody(w, r, &req, true); e != nil {
		return e
	}
	return s.withSandbox(r.Context(), id, func(b Box, rec record) error {
		d, err := seconds("timeout", req.Timeout, timeoutOf(b, 300*time.Second))
		if err != nil {
			return err
		}
		status := http.StatusOK
		if isPaused(b) {
			if b, err = s.unpause(r.Context(), b, d, req.Memory); err != nil {
				return err
			}
			status = http.StatusCreated
		} else if err := s.extend(r.Context(), b, d); err != nil {
			return err
		}
		writeJSON(w, status, s.sandboxJSON(b, rec))
		return nil
	})
}

// resume serves the deprecated POST /sandboxes/{id}/resume: a paused
// sandbox is resumed (201); a running one is a 409.
func (s *Server) resume(w http.ResponseWriter, r *http.Request, id string) error {
	var req timeoutJSON
	if e := decodeBody(w, r, &req, true); e != nil {
		return e
	}
	return s.withSandbox(r.Context(), id, func(b Box, rec record) error {
		if !isPaused(b) {
			return errorf(http.StatusConflict, "sandbox %s is already running", id)
		}
		d, err := seconds("timeout", req.Timeout, timeoutOf(b, defaultTimeout))
		if err == nil {
			b, err = s.unpause(r.Context(), b, d, req.Memory)
		}
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusCreated, s.sandboxJSON(b, rec))
		return nil
	})
}

// unpause resumes a paused sandbox (wake, or boot for one paused without
// its memory) with a deadline of now plus d. memory false (a connect that
// asks for a cold boot) is refused for a sandbox whose memory was kept:
// kvbox resumes it with it, and never drops it unasked; for one paused
// without its memory it is what happens anyway. The caller holds its
// opLock.
func (s *Server) unpause(ctx context.Context, b Box, d time.Duration, memory *bool) (Box, error) {
	if diskPaused(b) {
		return s.boot(ctx, b, d)
	}
	if memory != nil && !*memory {
		return Box{}, errorf(http.StatusBadRequest, "sandbox %s was paused with its memory, which kvbox serve resumes it with: a cold boot from its disk (memory false) is not done", b.Name)
	}
	return s.wake(ctx, b, d)
}

// boot resumes a sandbox paused without its memory: its box boots cold
// from its disk (same id, address and files; nothing that ran), and it is
// answered once its envd serves; then it loses its paused label and gets
// a deadline of now plus d. A boot that fails leaves it paused. The
// caller holds its opLock.
func (s *Server) boot(ctx context.Context, b Box, d time.Duration) (Box, error) {
	t0 := time.Now()
	if err := s.host.Boot(ctx, b.Name); err != nil {
		// A box whose agent did not answer is left running: shut it
		// down again, so that it is as it was (paused, its disk kept).
		if nb, gerr := s.host.Box(context.WithoutCancel(ctx), b.Name); gerr == nil && nb.State != Stopped {
			if serr := s.host.Stop(context.WithoutCancel(ctx), b.Name); serr != nil {
				err = fmt.Errorf("%w (and it could not be shut down again: %v)", err, serr)
			}
		}
		return Box{}, fmt.Errorf("boot sandbox %s from its disk: %w; it stays paused", b.Name, err)
	}
	if _, err := s.host.SetLabels(ctx, b.Name, withLabel(b.Labels, labelPaused, "")); err != nil {
		// It runs: a serve started again takes the label away (start0).
		s.logf("sandbox %s: booted, but its paused label stays: %v", b.Name, err)
	}
	at := time.Now().Add(d)
	nb, err := s.host.SetExpires(ctx, b.Name, &at)
	if err != nil {
		return Box{}, err
	}
	s.keep(nb)
	s.logf("sandbox %s booted from its disk in %.2fs (timeout %s)", b.Name, time.Since(t0).Seconds(), d)
	return nb, nil
}

// wake resumes a paused sandbox and gives it a deadline of now plus d.
// The caller holds its opLock.
func (s *Server) wake(ctx context.Context, b Box, d time.Duration) (Box, error) {
	t0 := time.Now()
	if err := s.host.Resume(ctx, b.Name); err != nil {
		return Box{}, fmt.Errorf("resume sandbox %s: %w", b.Name, err)
	}
	at := time.Now().Add(d)
	nb, err := s.host.SetExpires(ctx, b.Name, &at)
	if err != nil {
		return Box{}, err
	}
	s.keep(nb)
	s.logf("sandbox %s resumed in %.2fs (timeout %s)", b.Name, time.Since(t0).Seconds(), d)
	return nb, nil
}

// pause serves POST /sandboxes/{id}/pause: kvbox suspend, and no deadline
// while paused (a paused sandbox stays until it is connected to or
// killed). 409 when it is not running.
func (s *Server) pause(w http.ResponseWriter, r *http.Request, id string) error {
	var req pauseJSON
	if e := decodeBody(w, r, &req, true); e != nil {
		return e
	}
	return s.withSandbox(r.Context(), id, func(b Box, _ record) error {
		if isPaused(b) {
			return errorf(http.StatusConflict, "sandbox %s is already paused", id)
		}
		if req.Memory != nil && !*req.Memory {
			return s.pauseDisk(w, r, b)
		}
		t0 := time.Now()
		// The deadline goes first: a reaper must not remove the sandbox
		// being paused. Put back if the pause fails.
		if _, err := s.host.SetExpires(r.Context(), id, nil); err != nil {
			return err
		}
		if err := s.host.Suspend(r.Context(), id); err != nil {
			if _, rerr := s.host.SetExpires(context.WithoutCancel(r.Context()), id, b.Expires); rerr != nil {
				err = fmt.Errorf("%w (and its deadline could not be put back: %v)", err, rerr)
			}
			return fmt.Errorf("pause sandbox %s: %w", id, err)
		}
		if nb, err := s.host.Box(r.Context(), id); err == nil {
			s.keep(nb)
		}
		s.logf("sandbox %s paused in %.2fs", id, time.Since(t0).Seconds())
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

// pauseDisk is a pause without memory (E2B's filesystem-only pause): the
// box's guest is shut down and its QEMU ended; its disk is kept, nothing
// of its memory, and connect boots it from that disk. The deadline goes
// first and the paused label is set before the shutdown (a serve that
// dies in between finds a running box with it, which start0 mends); both
// are put back if the shutdown fails.
func (s *Server) pauseDisk(w http.ResponseWriter, r *http.Request, b Box) error {
	ctx, id := r.Context(), b.Name
	t0 := time.Now()
	if _, err := s.host.SetExpires(ctx, id, nil); err != nil {
		return err
	}
	undo := func(err error) error {
		bg := context.WithoutCancel(ctx)
		if _, lerr := s.host.SetLabels(bg, id, b.Labels); lerr != nil {
			err = fmt.Errorf("%w (and its labels could not be put back: %v)", err, lerr)
		}
		if _, rerr := s.host.SetExpires(bg, id, b.Expires); rerr != nil {
			err = fmt.Errorf("%w (and its deadline could not be put back: %v)", err, rerr)
		}
		return fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	if _, err := s.host.SetLabels(ctx, id, withLabel(b.Labels, labelPaused, pausedFilesystem)); err != nil {
		return undo(err)
	}
	if err := s.host.Stop(ctx, id); err != nil {
		// Shut down all the same (the error came after): paused.
		if nb, gerr := s.host.Box(context.WithoutCancel(ctx), id); gerr != nil || nb.State != Stopped {
			return undo(err)
		}
	}
	if nb, err := s.host.Box(ctx, id); err == nil {
		s.keep(nb)
	}
	s.logf("sandbox %s paused without its memory (shut down, its disk kept) in %.2fs", id, time.Since(t0).Seconds())
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// Template ids of fork snapshots, which serve takes for each fork and
// which go with their last clone: not listed as snapshots.
const forkPrefix = "e2bfork-"

// labelTemplateID is a fork's template id: its source's.
const labelTemplateID = "e2b.template-id"

// fork serves POST /sandboxes/{id}/fork: one snapshot of the running
// sandbox (it runs on), then count clones of it, each its own outcome.
func (s *Server) fork(w http.ResponseWriter, r *http.Request, id string) error {
	var req forkJSON
	if e := decodeBody(w, r, &req, true); e != nil {
		return e
	}
	count := 1
	if req.Count != nil {
		count = *req.Count
	}
	if count < 1 || count > 100 {
		return errorf(http.StatusBadRequest, "count %d: give 1 to 100", count)
	}
	b, rec, unlock, err := s.locked(r.Context(), id)
	if err != nil {
		return err
	}
	var d time.Duration
	err = running(b, id)
	if err == nil {
		d, err = seconds("timeout", req.Timeout, timeoutOf(b, defaultTimeout))
	}
	if err != nil {
		unlock()
		return err
	}
	// The snapshot's TTL keeps it while the forks are cloned from it;
	// then it is due at once (forkSnapshotDone), and goes with the last
	// fork.
	snap := forkPrefix + newID()[:16]
	exp := time.Now().Add(forkSnapshotTTL)
	t0 := time.Now()
	_, err = s.host.Snapshot(r.Context(), id, snap, &exp)
	unlock()
	if err != nil {
		return fmt.Errorf("fork sandbox %s: %w", id, err)
	}
	results := s.forks(r.Context(), b, rec, snap, d, count)
	ok := 0
	for _, x := range results {
		if x.Sandbox != nil {
			ok++
		}
	}
	s.forkSnapshotDone(r.Context(), snap, ok)
	s.logf("sandbox %s forked: %d of %d running in %.2fs", id, ok, count, time.Since(t0).Seconds())
	writeJSON(w, http.StatusCreated, results)
	return nil
}

// forkSnapshotDone ends the wait of fork snapshot snap, of which n forks
// run: it is due at once, so it goes with the last of them, whoever
// removes it (kill, its timeout, kvbox rm); with none it goes now. Should
// this fail, its TTL still takes it once its forks are gone.
func (s *Server) forkSnapshotDone(ctx context.Context, snap string, n int) {
	ctx = context.WithoutCancel(ctx)
	var err error
	if n == 0 {
		err = s.host.RemoveSnapshot(ctx, snap)
	} else {
		now := time.Now()
		err = s.host.SetSnapshotExpires(ctx, snap, &now)
	}
	if err != nil && !errors.Is(err, ErrBusy) {
		s.logf("fork snapshot %s: %v (it goes at its TTL, after its forks)", snap, err)
	}
}

// running refuses a paused sandbox: a snapshot is of a running one.
func running(b Box, id string) error {
	if b.State != Running {
		return errorf(http.StatusConflict, "sandbox %s is paused: connect to it first", id)
	}
	return nil
}

// forks starts count clones of snap, fork b's snapshot, at once, each with
// its own id and tokens and a deadline of now plus d, and b's labels but
// autoResume: each its sandbox or its error.
func (s *Server) forks(ctx context.Context, b Box, rec record, snap string, d time.Duration, count int) []forkResultJSON {
	labels := map[string]string{}
	for k, v := range b.Labels {
		if k != labelAutoResume {
			labels[k] = v
		}
	}
	labels[labelTemplateID] = cmp.Or(b.Labels[labelTemplateID], b.Snapshot)
	labels[labelTimeout] = strconv.FormatInt(int64(d/time.Second), 10)
	results := make([]forkResultJSON, count)
	var wg sync.WaitGroup
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fr := record{ID: newID(), AccessToken: newToken(), EnvVars: rec.EnvVars}
			if rec.TrafficToken != "" {
				fr.TrafficToken = newToken()
			}
			// The parent's rules, its own header secrets copied: they
			// are the fork's from now on, and outlive the parent.
			pl := forkPlan(rec, fr.ID)
			fr.Egress, fr.HeaderSecrets = pl.policy, pl.secrets
			fb, err := s.start(ctx, snap, labels, fr, d, startHow{noInternet: b.NoInternet, egress: pl.policy, headerSecrets: pl.secrets})
			if err != nil {
				status := http.StatusInternalServerError
				if errors.Is(err, ErrBusy) || errors.Is(err, ErrExists) {
					status = http.StatusConflict
				}
				results[i].Error = &errorJSON{Code: status, Message: err.Error()}
				return
			}
			j := s.sandboxJSON(fb, fr)
			results[i].Sandbox = &j
		}()
	}
	wg.Wait()
	return results
}

// forkSnapshotTTL bounds how long a fork's snapshot waits for its clones
// to be made (a serve that dies meanwhile leaves it to its TTL); it is
// kept while one of them is there.
const forkSnapshotTTL = 10 * time.Minute

// createSnapshot serves POST /sandboxes/{id}/snapshots: a kvbox snapshot
// of the running sandbox, which runs on; a template from then on.
func (s *Server) createSnapshot(w http.ResponseWriter, r *http.Request, id string) error {
	var req snapshotReqJSON
	if e := decodeBody(w, r, &req, true); e != nil {
		return e
	}
	name := req.Name
	if name == "" {
		name = "snap-" + newID()[:16]
	} else if !templateRe.MatchString(name) || strings.Contains(name, "..") || strings.HasPrefix(name, forkPrefix) {
		return errorf(http.StatusBadRequest, "snapshot name %q: give letters, digits, '-', '_' and '.' (it becomes a template's name)", name)
	}
	if req.Memory != nil && !*req.Memory {
		return errorf(http.StatusBadRequest, "a snapshot without memory: a kvbox snapshot is a running box's memory and disk, and its sandboxes start warm from it")
	}
	return s.withSandbox(r.Context(), id, func(b Box, _ record) error {
		if err := running(b, id); err != nil {
			return err
		}
		t0 := time.Now()
		snap, err := s.host.Snapshot(r.Context(), id, name, nil)
		if err != nil {
			return fmt.Errorf("snapshot of sandbox %s: %w", id, err)
		}
		s.logf("sandbox %s snapshotted as template %s in %.2fs", id, snap.Name, time.Since(t0).Seconds())
		writeJSON(w, http.StatusCreated, snapshotJSON{SnapshotID: snap.Name, Names: []string{snap.Name}})
		return nil
	})
}

// listSnapshots serves GET /snapshots: kvbox's snapshots (forks' own
// left out), newest first.
func (s *Server) listSnapshots(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	snaps, err := s.host.Snapshots(r.Context())
	if err != nil {
		s.fail(w, r, err)
		return
	}
	var out []Snapshot
	for _, sn := range snaps {
		if strings.HasPrefix(sn.Name, forkPrefix) ||
			q.Get("sandboxID") != "" && sn.Box != q.Get("sandboxID") || q.Get("name") != "" && sn.Name != q.Get("name") {
			continue
		}
		out = append(out, sn)
	}
	slices.SortFunc(out, func(a, b Snapshot) int {
		return -cmp.Or(a.Created.Compare(b.Created), strings.Compare(a.Name, b.Name))
	})
	page, next, err := paginate(out, q, true, func(sn Snapshot) string { return pageKey(sn.Created, sn.Name) })
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	js := []snapshotJSON{}
	for _, sn := range page {
		js = append(js, snapshotJSON{SnapshotID: sn.Name, Names: []string{sn.Name}})
	}
	writeJSON(w, http.StatusOK, js)
}

// deleteTemplate serves DELETE /templates/{id}: kvbox snapshots rm, refused
// (409) while sandboxes are cloned from it.
func (s *Server) deleteTemplate(w http.ResponseWriter, r *http.Request, id string) {
	if !templateRe.MatchString(id) || strings.Contains(id, "..") {
		s.fail(w, r, errorf(http.StatusNotFound, "template %s not found", id))
		return
	}
	if err := s.host.RemoveSnapshot(r.Context(), id); err != nil {
		if errors.Is(err, ErrNotFound) {
			err = errorf(http.StatusNotFound, "template %s not found", id)
		}
		s.fail(w, r, err)
		return
	}
	s.logf("template %s deleted", id)
	w.WriteHeader(http.StatusNoContent)
}
