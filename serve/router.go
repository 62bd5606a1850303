package serve

import (
	"context"
	"crypto/subtle"
	"encoding/binary"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"

	"kvbox.dev/kvbox/guest-agent/envd"
)

// data serves one request for port of sandbox id: the sandbox must be one
// of serve's and running (or paused with auto-resume), and the request must
// carry what that sandbox wants (its access token on envd's port; its
// traffic token on the others when it was made with one) before anything
// goes to its box.
func (s *Server) data(w http.ResponseWriter, r *http.Request, id string, port int) {
	b, err := s.cached(r.Context(), id)
	if err != nil {
		s.notServed(w, r, id, b, err)
		return
	}
	rec, ok := s.secrets.get(id)
	if !ok {
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "code": http.StatusBadGateway,
			"message": "kvbox serve lost the sandbox's access token (its folder of secrets): kill the sandbox"})
		return
	}
	if port == envd.Port {
		if why := envdAuthorized(r, rec.AccessToken); why != "" {
			unauthorized(w, r, why)
			return
		}
		if !tokenMatches(r, rec.AccessToken) {
			// Signed, not the token: the URL's user (or the default
			// one) is who reads or writes, not one a header picks.
			r.Header.Del("Authorization")
		}
		if !envdPath(r.URL.Path) {
			writeError(w, http.StatusNotFound, "%s %s: not a path of envd kvbox serve forwards", r.Method, r.URL.Path)
			return
		}
		if r.URL.Path == "/files" && r.Method == http.MethodPost && r.ContentLength > b.DiskBytes && b.DiskBytes > 0 {
			writeError(w, http.StatusRequestEntityTooLarge, "an upload of %d bytes is larger than the sandbox's disk (%d bytes)", r.ContentLength, b.DiskBytes)
			return
		}
	} else if rec.TrafficToken != "" && subtle.ConstantTimeCompare([]byte(r.Header.Get(hdrTraffic)), []byte(rec.TrafficToken)) != 1 {
		writeJSON(w, http.StatusForbidden, map[string]any{"sandboxId": id, "code": http.StatusForbidden,
			"message": "the sandbox's ports want its traffic access token (" + hdrTraffic + ")"})
		return
	} else if why := interpreterAuthorized(r, port, rec.AccessToken); why != "" {
		unauthorized(w, r, why)
		return
	}
	if diskPaused(b) {
		// Never resumed by traffic: a cold boot is asked for (connect).
		paused(w, r, id, false)
		return
	}
	if b.State == Suspended {
		if b.Labels[labelAutoResume] != "true" {
			paused(w, r, id, false)
			return
		}
		if b, err = s.autoResume(r.Context(), id); err != nil {
			s.notServed(w, r, id, b, err)
			return
		}
	}
	s.proxy(w, r, id, port)
}

// notServed answers a request for a sandbox serve cannot reach now, as
// E2B's proxy does: 502 for one that is gone or not running (the SDKs read
// it as "not running", isRunning false), 409 for a paused one.
func (s *Server) notServed(w http.ResponseWriter, r *http.Request, id string, b Box, err error) {
	switch {
	case errors.Is(err, errGone) && b.Name == "":
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "code": http.StatusBadGateway, "message": "The sandbox was not found"})
	case errors.Is(err, errGone):
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "code": http.StatusBadGateway, "message": "The sandbox is not running (its box is " + string(b.State) + ")"})
	case isPaused(b):
		paused(w, r, id, b.State == Suspended && b.Labels[labelAutoResume] == "true")
	case r.Context().Err() != nil:
	default:
		s.logf("sandbox %s: %v", id, err)
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "code": http.StatusBadGateway, "message": "kvbox serve cannot reach the sandbox: " + err.Error()})
	}
}

// paused answers a request for a paused sandbox: 409 and E2B proxy's JSON,
// or, for an RPC, a Connect error that says so (an SDK shows its message;
// of a bare 409 on a stream it would show only "HTTP 409").
//
// envd's GET /health is a 502 instead: the SDKs' isRunning reads 502, and
// nothing else, as "not running" (any other error status it raises), and a
// paused sandbox runs nothing.
func paused(w http.ResponseWriter, r *http.Request, id string, canAutoResume bool) {
	const msg = "The sandbox is paused: Sandbox.connect resumes it"
	if r.URL.Path == "/health" && r.Method == http.MethodGet {
		writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "code": http.StatusBadGateway,
			"message": msg, "canAutoResume": canAutoResume})
		return
	}
	if connectPath(r.URL.Path) {
		connectError(w, r, http.StatusConflict, "failed_precondition", msg)
		return
	}
	writeJSON(w, http.StatusConflict, map[string]any{"sandboxId": id, "code": http.StatusConflict,
		"message": msg, "canAutoResume": canAutoResume})
}

// connectError answers an RPC with a Connect error: for a streaming call
// (application/connect+...) a stream that is only its end, with the error;
// for a unary one, status and the error's JSON.
func connectError(w http.ResponseWriter, r *http.Request, status int, code, msg string) {
	ct := r.Header.Get("Content-Type")
	if !strings.HasPrefix(ct, "application/connect+") {
		writeJSON(w, status, map[string]string{"code": code, "message": msg})
		return
	}
	end, _ := json.Marshal(map[string]any{"error": map[string]string{"code": code, "message": msg}})
	frame := make([]byte, 5, 5+len(end))
	frame[0] = 2 // end of stream
	binary.BigEndian.PutUint32(frame[1:], uint32(len(end)))
	w.Header().Set("Content-Type", ct)
	w.WriteHeader(http.StatusOK)
	w.Write(append(frame, end...))
}

// autoResume wakes a paused sandbox made with auto-resume for a request
// that came for it, once for all the requests that wait.
func (s *Server) autoResume(ctx context.Context, id string) (Box, error) {
	unlock := s.opLock(id)
	defer unlock()
	b, err := s.lookup(ctx, id)
	if err != nil || b.State != Suspended {
		return b, err
	}
	return s.wake(ctx, b, timeoutOf(b, defaultTimeout))
}

// envdAuthorized says why a request may not reach the sandbox's envd, ""
// when it may: the sandbox's token, but for GET /health, and for /files
// the token or a URL signed with it.
func envdAuthorized(r *http.Request, token string) string {
	if r.URL.Path == "/health" && r.Method == http.MethodGet {
		return ""
	}
	if tokenMatches(r, token) {
		return ""
	}
	if r.URL.Path == "/files" && r.URL.Query().Get("signature") != "" {
		op := "read"
		if r.Method == http.MethodPost {
			op = "write"
		}
		return signatureOK(r, op, token)
	}
	return "missing or wrong access token (" + hdrAccessToken + ")"
}

// CodeInterpreterPort is where E2B's code interpreter SDKs send their
// cells (runCode's POST /execute) and manage contexts.
const CodeInterpreterPort = 49999

// interpreterAuthorized says why a request may not reach the code
// interpreter's port, "" when it may: a cell (POST /execute runs code, as
// the sandbox's user) wants the sandbox's access token, which every
// @e2b/code-interpreter sends there; on the other paths (contexts, health)
// a token that comes must be the sandbox's, and none may come, as the SDKs
// before the contexts' authentication send none. Serve takes the token off
// before the request crosses into the box, as on every port.
func interpreterAuthorized(r *http.Request, port int, token string) string {
	if port != CodeInterpreterPort {
		return ""
	}
	if (r.URL.Path == "/execute" || r.Header.Get(hdrAccessToken) != "") && !tokenMatches(r, token) {
		return "missing or wrong access token (" + hdrAccessToken + ") for the sandbox's code interpreter"
	}
	return ""
}

// tokenMatches says r carries token in X-Access-Token.
func tokenMatches(r *http.Request, token string) bool {
	return subtle.ConstantTimeCompare([]byte(r.Header.Get(hdrAccessToken)), []byte(token)) == 1
}

// connectPath says a path is a Connect RPC (its errors are Connect's JSON,
// with a code that is a name).
func connectPath(p string) bool {
	return strings.HasPrefix(p, "/process.Process/") || strings.HasPrefix(p, "/filesystem.Filesystem/")
}

// envdPath says a path is one of envd's that clients may use; its internal
// ones (/init and the like, which only E2B's orchestrator calls) are not.
func envdPath(p string) bool {
	switch p {
	case "/health", "/files", "/envs":
		return true
	}
	return connectPath(p)
}

// unauthorized answers 401 in the dialect of the path: a Connect error for
// an RPC (the SDKs raise AuthenticationError), E2B's error JSON otherwise.
func unauthorized(w http.ResponseWriter, r *http.Request, why string) {
	if connectPath(r.URL.Path) {
		connectError(w, r, http.StatusUnauthorized, "unauthenticated", why)
		return
	}
	writeError(w, http.StatusUnauthorized, "%s", why)
}

// proxy passes the request on to port in the sandbox's box, through its
// agent, with every credential taken off: the routing headers, the API
// key, the access and traffic tokens and a /files URL's signature. Serve
// checked them; envd trusts the agent channel's streams, and whatever
// reaches a guest, its snapshots carry to every clone. A port but envd's
// takes one of the box's slots for the request (streams.go), and its
// cookies are kept to the sandbox's own host (cookies.go).
func (s *Server) proxy(w http.ResponseWriter, r *http.Request, id string, port int) {
	s.mu.Lock()
	e := s.boxes[id]
	s.mu.Unlock()
	if e == nil {
		s.notServed(w, r, id, Box{}, errGone)
		return
	}
	target, tr := envdHost, e.tr.envd
	var modify func(*http.Response) error
	if port != envd.Port {
		release, ok := e.tr.take()
		if !ok {
			portsBusy(w, id, port, cap(e.tr.slots))
			return
		}
		defer release()
		target, tr = "127.0.0.1:"+strconv.Itoa(port), e.tr.ports
		modify = s.ownCookies(id, port)
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = target
			pr.Out.Host = pr.In.Host
			h := pr.Out.Header
			h.Del(hdrSandboxID)
			h.Del(hdrSandboxPort)
			h.Del(hdrAPIKey)
			h.Del(hdrTraffic)
			h.Del(hdrAccessToken)
			if port == envd.Port && pr.Out.URL.Path == "/files" {
				q := pr.Out.URL.Query()
				q.Del("signature")
				q.Del("signature_expiration")
				pr.Out.URL.RawQuery = q.Encode()
			}
		},
		Transport:      tr,
		ModifyResponse: modify,
		// Every frame of a stream (a command's output) as it comes.
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				return
			}
			b, lerr := s.lookup(r.Context(), id)
			switch {
			case lerr != nil || b.State != Running:
				s.notServed(w, r, id, b, lerr)
			case port == envd.Port:
				s.logf("sandbox %s: envd: %v", id, err)
				writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "code": http.StatusBadGateway,
					"message": "the sandbox's envd did not answer: " + err.Error()})
			default:
				writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "code": http.StatusBadGateway,
					"message": "The sandbox is running but port is not open", "port": strconv.Itoa(port)})
			}
		},
	}
	rp.ServeHTTP(w, r)
}
