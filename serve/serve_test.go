package serve

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/guest-agent/envd"
)

// created is a sandbox made through the API.
type created struct {
	ID, Token string
	JSON      map[string]any
}

func create(t *testing.T, ts *httptest.Server, body string) created {
	t.Helper()
	status, out, _ := call(t, ts, "POST", "/v2/sandboxes", body, "Content-Type: application/json")
	if status != http.StatusCreated {
		t.Fatalf("create %s: %d %s", body, status, out)
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		t.Fatal(err)
	}
	return created{ID: m["sandboxID"].(string), Token: m["envdAccessToken"].(string), JSON: m}
}

// errorShape checks body is E2B's error JSON: a numeric code equal to the
// status and a message.
func errorShape(t *testing.T, what string, status int, body string, want int) {
	t.Helper()
	if status != want {
		t.Errorf("%s: status %d, want %d (%s)", what, status, want, body)
		return
	}
	var e struct {
		Code    *int    `json:"code"`
		Message *string `json:"message"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Code == nil || *e.Code != want || e.Message == nil || *e.Message == "" {
		t.Errorf("%s: body %q is not {\"code\": %d, \"message\": ...}", what, body, want)
	}
}

// golden compares v, as indented JSON with the volatile values given
// names, with testdata/NAME.json (KVBOX_UPDATE_GOLDEN=1 writes it).
func golden(t *testing.T, name string, v any, names map[string]string) {
	t.Helper()
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	got := string(b) + "\n"
	keys := make([]string, 0, len(names))
	for k := range names {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return len(keys[i]) > len(keys[j]) })
	for _, k := range keys {
		got = strings.ReplaceAll(got, k, names[k])
	}
	path := filepath.Join("testdata", name+".json")
	if os.Getenv("KVBOX_UPDATE_GOLDEN") != "" {
		os.MkdirAll("testdata", 0o755)
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (KVBOX_UPDATE_GOLDEN=1 writes it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from %s:\n%s", name, path, got)
	}
}

// requireKeys checks the keys an SDK's parser requires (the Python SDK pops
// them) are in m.
func requireKeys(t *testing.T, what string, m map[string]any, keys ...string) {
	t.Helper()
	for _, k := range keys {
		if _, ok := m[k]; !ok {
			t.Errorf("%s lacks %q, which the SDKs' parsers require: %v", what, k, m)
		}
	}
}

// The Sandbox, SandboxDetail and ListedSandbox bodies: every field the
// SDKs' parsers require, RFC 3339 times, a numeric-free state, the domain
// and envd version always there.
func TestGoldenSandboxJSON(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	sb := create(t, ts, `{"templateID":"warm","timeout":120,"metadata":{"owner":"ci","job":"17"},"envVars":{"FOO":"bar"},"secure":true,"allow_internet_access":true,"someFieldFromTheFuture":{"x":1}}`)
	names := map[string]string{sb.ID: "SANDBOX-ID", sb.Token: "ACCESS-TOKEN"}
	b, _ := h.Box(context.Background(), sb.ID)
	names[b.Expires.UTC().Format(time.RFC3339)] = "END-AT"
	requireKeys(t, "Sandbox", sb.JSON, "templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken", "domain", "trafficAccessToken")
	golden(t, "sandbox", sb.JSON, names)

	status, out, _ := call(t, ts, "GET", "/sandboxes/"+sb.ID, "")
	if status != http.StatusOK {
		t.Fatalf("get: %d %s", status, out)
	}
	var detail map[string]any
	json.Unmarshal([]byte(out), &detail)
	requireKeys(t, "SandboxDetail", detail, "templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB", "state", "envdVersion")
	golden(t, "sandbox-detail", detail, names)

	status, out, hdr := call(t, ts, "GET", "/v2/sandboxes", "")
	if status != http.StatusOK {
		t.Fatalf("list: %d %s", status, out)
	}
	var list []map[string]any
	json.Unmarshal([]byte(out), &list)
	if len(list) != 1 {
		t.Fatalf("list: %s", out)
	}
	requireKeys(t, "ListedSandbox", list[0], "templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB", "state", "envdVersion")
	golden(t, "listed-sandbox", list, names)
	if hdr.Get("X-Total-Running") != "1" || hdr.Get("X-Next-Token") != "" {
		t.Errorf("list headers: %v", hdr)
	}
	// The variables are the sandbox's secret: in no answer.
	for _, body := range []string{fmt.Sprint(sb.JSON), fmt.Sprint(detail), fmt.Sprint(list)} {
		if strings.Contains(body, "bar") {
			t.Errorf("a sandbox's envVars in an answer: %s", body)
		}
	}
}

// The box a create makes: a clone of the named snapshot, its deadline the
// timeout, metadata in its labels, its envd given the token, variables,
// ids and the user "user"; the token and variables kept in serve's folder,
// root's only, not in the labels.
func TestCreateMapsOntoAClone(t *testing.T) {
	h := newFakeHost()
	dir := t.TempDir()
	_, ts := newTestServer(t, h, dir)
	t0 := time.Now()
	sb := create(t, ts, `{"templateID":"team/warm:v2","timeout":60,"metadata":{"k":"v"},"envVars":{"SECRET":"s3cr3t"},"allow_internet_access":false}`)
	b, err := h.Box(context.Background(), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if b.Snapshot != "warm" || b.Labels[labelTemplate] != "team/warm:v2" || b.Labels[labelMetadata+"k"] != "v" || !b.NoInternet {
		t.Errorf("the clone: %+v", b)
	}
	if d := b.Expires.Sub(t0); d < 58*time.Second || d > 62*time.Second {
		t.Errorf("deadline %s after the create, want 60s", d)
	}
	// The guest's envd gets the sandbox's variables, never the client's
	// token: a snapshot would carry it to every clone.
	if cfg := h.envd[sb.ID]; strings.Contains(cfg, sb.Token) || !strings.Contains(cfg, "s3cr3t") {
		t.Errorf("the clone's envd configuration: %s", cfg)
	}
	for k, v := range b.Labels {
		if strings.Contains(k+v, "s3cr3t") || strings.Contains(k+v, sb.Token) {
			t.Errorf("a secret in the box's labels: %s=%s", k, v)
		}
	}
	if !regexp.MustCompile(`^[a-z0-9]{20}$`).MatchString(sb.ID) {
		t.Errorf("sandbox id %q is not 20 of [a-z0-9]", sb.ID)
	}
	fi, err := os.Stat(filepath.Join(dir, sb.ID+".json"))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the sandbox's secrets file: %v %v", fi, err)
	}
	if dfi, _ := os.Stat(dir); dfi.Mode().Perm() != 0o700 {
		t.Errorf("serve's folder is %v", dfi.Mode())
	}
	rec, _ := readRecord(filepath.Join(dir, sb.ID+".json"))
	if rec.AccessToken != sb.Token || rec.EnvVars["SECRET"] != "s3cr3t" {
		t.Errorf("the record: %+v", rec)
	}
}

// Every error is E2B's shape, never a hang: malformed, unknown, oversized,
// refused.
func TestErrorShapes(t *testing.T) {
	h := newFakeHost()
	h.failClone["broken"] = fmt.Errorf("the clone's agent did not answer")
	h.snaps["broken"] = Snapshot{Name: "broken"}
	_, ts := newTestServer(t, h, "")
	for _, tc := range []struct {
		name, method, path, body string
		headers                  []string
		want                     int
	}{
		{"no key", "POST", "/sandboxes", `{"templateID":"warm"}`, []string{"X-API-Key: "}, 401},
		{"wrong key", "GET", "/v2/sandboxes", "", []string{"X-API-Key: e2b_0000000000000000000000000000000000000000"}, 401},
		{"malformed body", "POST", "/sandboxes", `{"templateID":`, nil, 400},
		{"body of the wrong type", "POST", "/sandboxes", `{"templateID":17}`, nil, 400},
		{"no body", "POST", "/sandboxes", ``, nil, 400},
		{"no template", "POST", "/sandboxes", `{"timeout":10}`, nil, 400},
		{"unknown template", "POST", "/v2/sandboxes", `{"templateID":"base"}`, nil, 404},
		{"template that is no name", "POST", "/sandboxes", `{"templateID":"no such name!"}`, nil, 400},
		{"negative timeout", "POST", "/sandboxes", `{"templateID":"warm","timeout":-1}`, nil, 400},
		{"bad variable", "POST", "/sandboxes", `{"templateID":"warm","envVars":{"A=B":"x"}}`, nil, 400},
		{"control characters in metadata", "POST", "/sandboxes", `{"templateID":"warm","metadata":{"k":"a\u0001"}}`, nil, 400},
		{"header rules", "POST", "/sandboxes", `{"templateID":"warm","network":{"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"api.example.com":{"transform":{"headers":{"A":"b"}}}}}}`, nil, 400},
		{"a private range allowed", "POST", "/sandboxes", `{"templateID":"warm","network":{"allowOut":["10.0.0.0/8"],"denyOut":["0.0.0.0/0"]}}`, nil, 400},
		{"an egress proxy", "POST", "/sandboxes", `{"templateID":"warm","network":{"egressProxy":{"address":"socks5://x:1"}}}`, nil, 400},
		{"a clone that fails", "POST", "/sandboxes", `{"templateID":"broken"}`, nil, 500},
		{"oversized body", "POST", "/sandboxes", `{"templateID":"warm","metadata":{"k":"` + strings.Repeat("x", maxBody) + `"}}`, nil, 413},
		{"unknown sandbox", "GET", "/sandboxes/nosuchsandbox0000000", "", nil, 404},
		{"kill an unknown sandbox", "DELETE", "/sandboxes/nosuchsandbox0000000", "", nil, 404},
		{"timeout of an unknown sandbox", "POST", "/sandboxes/nosuchsandbox0000000/timeout", `{"timeout":10}`, nil, 404},
		{"connect an unknown sandbox", "POST", "/v2/sandboxes/nosuchsandbox0000000/connect", `{"timeout":10}`, nil, 404},
		{"pause an unknown sandbox", "POST", "/sandboxes/nosuchsandbox0000000/pause", `{}`, nil, 404},
		{"an id that is no id", "GET", "/sandboxes/..%2f..", "", nil, 404},
		{"unknown call", "POST", "/sandboxes/x/frobnicate", "", nil, 404},
		{"unknown path", "GET", "/teams", "", nil, 404},
		{"wrong method", "PUT", "/sandboxes", "", nil, 405},
		{"metrics", "GET", "/sandboxes/x/metrics", "", nil, 501},
		{"delete an unknown template", "DELETE", "/templates/nosuch", "", nil, 404},
		{"bad page size", "GET", "/v2/sandboxes?limit=1000", "", nil, 400},
		{"bad state", "GET", "/v2/sandboxes?state=sleeping", "", nil, 400},
	} {
		status, body, _ := call(t, ts, tc.method, tc.path, tc.body, tc.headers...)
		errorShape(t, tc.name, status, body, tc.want)
	}
	if n := len(h.boxes); n != 0 {
		t.Errorf("%d boxes left by failed creates", n)
	}
	status, body, _ := call(t, ts, "GET", "/health", "", "X-API-Key: ")
	if status != http.StatusNoContent {
		t.Errorf("/health without a key: %d %s", status, body)
	}
}

// The data plane: by headers, by Host, by signature; each sandbox's token
// checked on the host, another sandbox's refused, nothing reaching a box
// before it passed; the routing headers and the API key never reach a box,
// the access token only envd.
func TestRouter(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	b := create(t, ts, `{"templateID":"warm"}`)
	rpc := "/process.Process/Start"

	// The SDK's request: routing headers, token, API key (apiHeaders leak).
	status, body, _ := call(t, ts, "POST", rpc, "{}", "E2b-Sandbox-Id: "+a.ID, "E2b-Sandbox-Port: 49983", "X-Access-Token: "+a.Token)
	if status != 200 || body != a.ID+" envd "+rpc {
		t.Fatalf("to a's envd: %d %s", status, body)
	}
	seen := h.seen(a.ID)
	if len(seen) != 1 {
		t.Fatalf("a saw %d requests", len(seen))
	}
	for _, k := range []string{"E2b-Sandbox-Id", "E2b-Sandbox-Port", "X-Api-Key"} {
		if seen[0].Header.Get(k) != "" {
			t.Errorf("%s reached the box", k)
		}
	}
	// Whatever reaches a guest its snapshots carry to every clone: the
	// client's token stays on the host.
	if seen[0].Header.Get("X-Access-Token") != "" {
		t.Errorf("the access token reached envd")
	}

	// Another port: by header and by Host; no access token passed on.
	status, body, _ = call(t, ts, "GET", "/index.html", "", "E2b-Sandbox-Id: "+a.ID, "E2b-Sandbox-Port: 8000", "X-Access-Token: "+a.Token)
	if status != 200 || body != a.ID+" 127.0.0.1:8000 /index.html" {
		t.Errorf("to a's port 8000 by header: %d %s", status, body)
	}
	status, body, _ = call(t, ts, "GET", "/x", "", "Host: 8000-"+b.ID+"."+testDomain, "X-API-Key: ")
	if status != 200 || body != b.ID+" 127.0.0.1:8000 /x" {
		t.Errorf("to b's port 8000 by Host: %d %s", status, body)
	}
	status, body, _ = call(t, ts, "GET", "/x", "", "Host: 8000-"+b.ID+".kvbox.localhost", "X-API-Key: ")
	if status != 200 {
		t.Errorf("by Host without the listener's port: %d %s", status, body)
	}
	for _, s := range h.seen(a.ID)[1:] {
		if s.Header.Get("X-Access-Token") != "" || s.Header.Get("X-Api-Key") != "" {
			t.Errorf("a token or the API key reached port 8000: %v", s.Header)
		}
	}

	// Refused on the host: nothing more reaches either box.
	before := len(h.seen(a.ID)) + len(h.seen(b.ID))
	for _, tc := range []struct {
		name    string
		path    string
		headers []string
		want    int
		connect bool
	}{
		{"no token", rpc, []string{"E2b-Sandbox-Id: " + a.ID}, 401, true},
		{"a wrong token", rpc, []string{"E2b-Sandbox-Id: " + a.ID, "X-Access-Token: " + strings.Repeat("0", 64)}, 401, true},
		{"b's token for a", rpc, []string{"E2b-Sandbox-Id: " + a.ID, "X-Access-Token: " + b.Token}, 401, true},
		{"b's token for a's files", "/files?path=/etc/passwd", []string{"E2b-Sandbox-Id: " + a.ID, "X-Access-Token: " + b.Token}, 401, false},
		{"the API key for a token", "/filesystem.Filesystem/ListDir", []string{"E2b-Sandbox-Id: " + a.ID}, 401, true},
		{"envd's internal /init", "/init", []string{"E2b-Sandbox-Id: " + a.ID, "X-Access-Token: " + a.Token}, 404, false},
		{"an unknown sandbox", rpc, []string{"E2b-Sandbox-Id: nosuchsandbox0000000", "X-Access-Token: " + a.Token}, 502, false},
		{"a port that is no port", rpc, []string{"E2b-Sandbox-Id: " + a.ID, "E2b-Sandbox-Port: http"}, 400, false},
	} {
		status, body, _ := call(t, ts, "POST", tc.path, "{}", tc.headers...)
		if tc.connect {
			var e struct{ Code, Message string }
			if status != tc.want || json.Unmarshal([]byte(body), &e) != nil || e.Code != "unauthenticated" {
				t.Errorf("%s: %d %s, want %d with a Connect error", tc.name, status, body, tc.want)
			}
			continue
		}
		errorShape(t, tc.name, status, body, tc.want)
	}
	if after := len(h.seen(a.ID)) + len(h.seen(b.ID)); after != before {
		t.Errorf("%d refused requests reached a box", after-before)
	}
	// /health needs no token.
	if status, body, _ := call(t, ts, "GET", "/health", "", "E2b-Sandbox-Id: "+a.ID); status != 200 {
		t.Errorf("envd /health without a token: %d %s", status, body)
	}
}

// Signed /files URLs carry no sandbox id and no header: the signature
// tells the sandbox, checked as envd checks it (path, operation, user,
// expiry); a tampered one reaches no box. A header-less /files with a
// token (SDKs before JS 2.14.1) goes to that token's sandbox.
func TestSignedFiles(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	b := create(t, ts, `{"templateID":"warm"}`)
	sign := func(tok, path, op, user string, exp int64) string {
		q := url.Values{"path": {path}, "signature": {envd.Signature(path, op, user, tok, exp)}}
		if user != "" {
			q.Set("username", user)
		}
		if exp != 0 {
			q.Set("signature_expiration", fmt.Sprint(exp))
		}
		return "/files?" + q.Encode()
	}
	later := time.Now().Add(time.Hour).Unix()
	status, body, _ := call(t, ts, "GET", sign(b.Token, "/home/user/x", "read", "user", later), "", "X-API-Key: ")
	if status != 200 || !strings.HasPrefix(body, b.ID+" envd /files") {
		t.Errorf("a signed download of b's: %d %s", status, body)
	}
	status, body, _ = call(t, ts, "POST", sign(a.Token, "/tmp/up", "write", "", 0), "data", "X-API-Key: ")
	if status != 200 || !strings.HasPrefix(body, a.ID+" ") {
		t.Errorf("a signed upload to a: %d %s", status, body)
	}
	status, body, _ = call(t, ts, "GET", "/files?path=/tmp/x", "", "X-API-Key: ", "X-Access-Token: "+a.Token)
	if status != 200 || !strings.HasPrefix(body, a.ID+" ") {
		t.Errorf("a header-less /files with a's token: %d %s", status, body)
	}
	before := len(h.seen(a.ID)) + len(h.seen(b.ID))
	for name, path := range map[string]string{
		"another path":                 strings.Replace(sign(a.Token, "/tmp/x", "read", "", 0), "%2Ftmp%2Fx", "%2Fetc%2Fshadow", 1),
		"a read signature for writing": sign(a.Token, "/tmp/x", "read", "", 0),
		"expired":                      sign(a.Token, "/tmp/x", "write", "", time.Now().Add(-time.Minute).Unix()),
		"another user":                 strings.Replace(sign(a.Token, "/tmp/x", "write", "user", 0), "username=user", "username=root", 1),
	} {
		status, body, _ := call(t, ts, "POST", path, "x", "X-API-Key: ")
		errorShape(t, name, status, body, 401)
	}
	// Routed by the headers, the signature is checked against that
	// sandbox's token alone.
	status, body, _ = call(t, ts, "GET", sign(b.Token, "/tmp/x", "read", "", 0), "", "X-API-Key: ", "E2b-Sandbox-Id: "+a.ID)
	errorShape(t, "b's signature for a's files", status, body, 401)
	if after := len(h.seen(a.ID)) + len(h.seen(b.ID)); after != before {
		t.Errorf("%d refused /files requests reached a box", after-before)
	}
	status, body, _ = call(t, ts, "GET", sign(a.Token, "/tmp/x", "read", "", 0), "", "X-API-Key: ", "E2b-Sandbox-Id: "+a.ID)
	if status != 200 || !strings.HasPrefix(body, a.ID+" ") {
		t.Errorf("a's signature with a's routing headers: %d %s", status, body)
	}
	// What reached the boxes: no token, no signature (a clone that finds
	// one in its memory could replay it), and for a signed URL no user
	// but the one signed (an Authorization header cannot pick root).
	status, body, _ = call(t, ts, "GET", sign(a.Token, "/tmp/x", "read", "", 0), "", "X-API-Key: ", "Authorization: Basic cm9vdDo=")
	if status != 200 {
		t.Errorf("a signed download with an Authorization header: %d %s", status, body)
	}
	status, body, _ = call(t, ts, "GET", "/files?path=/tmp/x", "", "X-API-Key: ", "X-Access-Token: "+a.Token, "Authorization: Basic cm9vdDo=")
	if status != 200 {
		t.Errorf("a download with the token and a user: %d %s", status, body)
	}
	seen := append(h.seen(a.ID), h.seen(b.ID)...)
	for _, r := range seen {
		if r.Header.Get("X-Access-Token") != "" || strings.Contains(r.Query, "signature") {
			t.Errorf("a credential reached the box: %s %s?%s %v", r.Method, r.Path, r.Query, r.Header)
		}
		if !strings.Contains(r.Query, "path=") {
			t.Errorf("the path did not reach the box: %s?%s", r.Path, r.Query)
		}
	}
	last2 := h.seen(a.ID)[len(h.seen(a.ID))-2:]
	if last2[0].Header.Get("Authorization") != "" {
		t.Errorf("a signed URL's request passed an Authorization header on")
	}
	if last2[1].Header.Get("Authorization") == "" {
		t.Errorf("a token holder's user (Authorization) did not reach envd")
	}
}

// A sandbox that is paused is a 409 on its data plane (an auto-resume one
// wakes), one removed or stopped a 502, as E2B's proxy answers; a port
// nothing listens on a 502 naming it; an upload larger than the box's
// disk is refused before it crosses.
func TestDataPlaneStates(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	ping := func() (int, string) {
		s, b, _ := call(t, ts, "GET", "/envs", "", "E2b-Sandbox-Id: "+a.ID, "X-Access-Token: "+a.Token)
		return s, b
	}
	if s, b := ping(); s != 200 {
		t.Fatalf("running: %d %s", s, b)
	}
	if s, b, _ := call(t, ts, "GET", "/", "", "E2b-Sandbox-Id: "+a.ID, "E2b-Sandbox-Port: 9999"); s != 502 || !strings.Contains(b, `"port":"9999"`) {
		t.Errorf("a closed port: %d %s", s, b)
	}
	h.mu.Lock()
	h.disk = 1 << 10
	h.mu.Unlock()
	small := create(t, ts, `{"templateID":"warm"}`)
	s, b, _ := call(t, ts, "POST", "/files?path=/big", strings.Repeat("x", 2<<10), "E2b-Sandbox-Id: "+small.ID, "X-Access-Token: "+small.Token)
	errorShape(t, "an upload larger than the disk", s, b, 413)
	if n := len(h.seen(small.ID)); n != 0 {
		t.Errorf("the oversized upload reached the box")
	}
	if s, b, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{}`); s != 204 {
		t.Fatalf("pause: %d %s", s, b)
	}
	s, b = ping()
	errorShape(t, "a paused sandbox", s, b, 409)
	if s, b, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{}`); s != 409 {
		t.Errorf("pausing a paused sandbox: %d %s (the SDK reads 409 as already paused)", s, b)
	}
	if s, b, _ := call(t, ts, "POST", "/v2/sandboxes/"+a.ID+"/connect", `{"timeout":30}`); s != 201 {
		t.Errorf("connect to a paused sandbox: %d %s, want 201 (resumed)", s, b)
	}
	if s, b := ping(); s != 200 {
		t.Errorf("after connect: %d %s", s, b)
	}
	h.stop(a.ID)
	// serve learns it at the next failure.
	s, b = ping()
	errorShape(t, "a stopped sandbox", s, b, 502)
	if s, b := ping(); s != 502 {
		t.Errorf("a stopped sandbox, again: %d %s", s, b)
	}
	if s, b, _ := call(t, ts, "DELETE", "/sandboxes/"+a.ID, ""); s != 204 {
		t.Errorf("kill a stopped sandbox: %d %s", s, b)
	}
	s, b = ping()
	errorShape(t, "a killed sandbox", s, b, 502)
}

// deadline is the box's deadline, from now.
func deadline(t *testing.T, h *fakeHost, id string) time.Duration {
	t.Helper()
	b, err := h.Box(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if b.Expires == nil {
		return 0
	}
	return time.Until(*b.Expires).Round(time.Minute)
}

// setTimeout moves the deadline either way; connect only extends it; a
// paused sandbox has none, and connect gives it one.
func TestTimeouts(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm","timeout":3600}`)
	if d := deadline(t, h, a.ID); d != time.Hour {
		t.Fatalf("deadline %s", d)
	}
	if s, b, _ := call(t, ts, "POST", "/v2/sandboxes/"+a.ID+"/connect", `{"timeout":600}`); s != 200 {
		t.Fatalf("connect: %d %s", s, b)
	}
	if d := deadline(t, h, a.ID); d != time.Hour {
		t.Errorf("connect with a shorter timeout moved the deadline to %s", d)
	}
	if s, b, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/connect", `{"timeout":7200}`); s != 200 {
		t.Fatalf("connect (v1): %d %s", s, b)
	}
	if d := deadline(t, h, a.ID); d != 2*time.Hour {
		t.Errorf("connect with a longer timeout: %s", d)
	}
	if s, b, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/timeout", `{"timeout":300}`); s != 204 {
		t.Fatalf("timeout: %d %s", s, b)
	}
	if d := deadline(t, h, a.ID); d != 5*time.Minute {
		t.Errorf("setTimeout 300: %s", d)
	}
	s, b, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/timeout", `{}`)
	errorShape(t, "timeout without one", s, b, 400)
	call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{}`)
	if d := deadline(t, h, a.ID); d != 0 {
		t.Errorf("a paused sandbox's deadline: %s", d)
	}
	if s, b, _ := call(t, ts, "POST", "/v2/sandboxes/"+a.ID+"/connect", `{"timeout":900}`); s != 201 {
		t.Fatalf("connect a paused one: %d %s", s, b)
	}
	if d := deadline(t, h, a.ID); d != 15*time.Minute {
		t.Errorf("a resumed sandbox's deadline: %s", d)
	}
}

// A serve started again over the same host and folder serves the same
// sandboxes with the same tokens; the secrets of a sandbox whose box went
// while it was down are pruned.
func TestRestart(t *testing.T) {
	h := newFakeHost()
	dir := t.TempDir()
	s1, ts1 := newTestServer(t, h, dir)
	a := create(t, ts1, `{"templateID":"warm"}`)
	b := create(t, ts1, `{"templateID":"warm"}`)
	ts1.Close()
	s1.Close()
	h.Remove(context.Background(), b.ID) // its TTL, while serve was down
	_, ts2 := newTestServer(t, h, dir)
	if s, body, _ := call(t, ts2, "GET", "/envs", "", "E2b-Sandbox-Id: "+a.ID, "X-Access-Token: "+a.Token); s != 200 {
		t.Errorf("a after the restart: %d %s", s, body)
	}
	s, body, _ := call(t, ts2, "POST", "/sandboxes/"+a.ID+"/connect", `{"timeout":60}`)
	if s != 200 || !strings.Contains(body, a.Token) {
		t.Errorf("connect after the restart: %d %s", s, body)
	}
	if _, err := os.Stat(filepath.Join(dir, b.ID+".json")); !os.IsNotExist(err) {
		t.Errorf("the secrets of a removed sandbox were not pruned: %v", err)
	}
	s, body, _ = call(t, ts2, "GET", "/envs", "", "E2b-Sandbox-Id: "+b.ID, "X-Access-Token: "+b.Token)
	errorShape(t, "b after the restart", s, body, 502)
}

// fork: one snapshot, count clones of it, each with its own id and token
// and its own outcome; the source runs on; its snapshot is not listed.
func TestFork(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm","metadata":{"k":"v"},"envVars":{"FOO":"1"}}`)
	s, body, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/fork", `{"count":3,"timeout":60}`)
	if s != 201 {
		t.Fatalf("fork: %d %s", s, body)
	}
	var res []forkResultJSON
	if err := json.Unmarshal([]byte(body), &res); err != nil || len(res) != 3 {
		t.Fatalf("fork: %s", body)
	}
	seen := map[string]bool{a.ID: true, a.Token: true}
	for _, r := range res {
		if r.Sandbox == nil || seen[r.Sandbox.SandboxID] || seen[r.Sandbox.EnvdAccessToken] {
			t.Fatalf("fork results: %s", body)
		}
		seen[r.Sandbox.SandboxID], seen[r.Sandbox.EnvdAccessToken] = true, true
		if r.Sandbox.TemplateID != "warm" {
			t.Errorf("a fork's template: %q", r.Sandbox.TemplateID)
		}
		fb, _ := h.Box(context.Background(), r.Sandbox.SandboxID)
		if !strings.HasPrefix(fb.Snapshot, forkPrefix) || fb.Labels[labelMetadata+"k"] != "v" {
			t.Errorf("a fork's box: %+v", fb)
		}
	}
	snaps := 0
	for _, c := range h.calls {
		if strings.HasPrefix(c, "snapshot "+a.ID) {
			snaps++
		}
	}
	if snaps != 1 {
		t.Errorf("%d snapshots for one fork of 3", snaps)
	}
	if s, body, _ := call(t, ts, "GET", "/snapshots", ""); s != 200 || strings.Contains(body, forkPrefix) {
		t.Errorf("snapshots: %d %s", s, body)
	}
	// Of a fork of three, one fails alone.
	h.mu.Lock()
	h.failNth = h.clones + 2
	h.mu.Unlock()
	s, body, _ = call(t, ts, "POST", "/sandboxes/"+a.ID+"/fork", `{"count":3}`)
	if s != 201 {
		t.Fatalf("fork: %d %s", s, body)
	}
	res = nil
	json.Unmarshal([]byte(body), &res)
	ok, failed := 0, 0
	for _, r := range res {
		switch {
		case r.Sandbox != nil:
			ok++
		case r.Error != nil && r.Error.Code >= 400 && r.Error.Message != "":
			failed++
		}
	}
	if ok != 2 || failed != 1 {
		t.Errorf("a fork of 3 with one failing: %s", body)
	}
}

// createSnapshot: a template named as asked (or not), listed by sandbox,
// a sandbox can be created from it; deleting it is refused while it has
// clones.
func TestSnapshots(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	s, body, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/snapshots", `{"name":"mine"}`)
	if s != 201 || body != `{"snapshotID":"mine","names":["mine"]}`+"\n" {
		t.Fatalf("snapshot: %d %s", s, body)
	}
	s, body, _ = call(t, ts, "POST", "/sandboxes/"+a.ID+"/snapshots", `{"name":"mine"}`)
	errorShape(t, "a snapshot name taken", s, body, 409)
	s, body, _ = call(t, ts, "POST", "/sandboxes/"+a.ID+"/snapshots", `{}`)
	if s != 201 || !strings.Contains(body, `"snapshotID":"snap-`) {
		t.Fatalf("snapshot without a name: %d %s", s, body)
	}
	s, body, _ = call(t, ts, "GET", "/snapshots?sandboxID="+a.ID+"&limit=1", "")
	var page []snapshotJSON
	json.Unmarshal([]byte(body), &page)
	_, _, hdr := call(t, ts, "GET", "/snapshots?sandboxID="+a.ID+"&limit=1", "")
	if s != 200 || len(page) != 1 || hdr.Get("X-Next-Token") == "" {
		t.Fatalf("snapshots of a, page 1: %d %s %v", s, body, hdr)
	}
	_, body2, hdr2 := call(t, ts, "GET", "/snapshots?sandboxID="+a.ID+"&limit=1&nextToken="+url.QueryEscape(hdr.Get("X-Next-Token")), "")
	var page2 []snapshotJSON
	json.Unmarshal([]byte(body2), &page2)
	if len(page2) != 1 || page2[0].SnapshotID == page[0].SnapshotID || hdr2.Get("X-Next-Token") != "" {
		t.Errorf("snapshots of a, page 2: %s %v", body2, hdr2)
	}
	b := create(t, ts, `{"templateID":"mine"}`)
	s, body, _ = call(t, ts, "DELETE", "/templates/mine", "")
	errorShape(t, "a template with clones", s, body, 409)
	call(t, ts, "DELETE", "/sandboxes/"+b.ID, "")
	if s, body, _ := call(t, ts, "DELETE", "/templates/mine", ""); s != 204 {
		t.Errorf("delete a template: %d %s", s, body)
	}
}

// list: metadata (as the SDKs encode it) and state filters, pages in
// order with X-Next-Token; v1 lists the running ones.
func TestList(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	var ids []string
	for i := range 5 {
		sb := create(t, ts, fmt.Sprintf(`{"templateID":"warm","metadata":{"job":"%d","team":"a b&c=d"}}`, i%2))
		ids = append(ids, sb.ID)
	}
	call(t, ts, "POST", "/sandboxes/"+ids[4]+"/pause", `{}`)
	list := func(q string) ([]listedJSON, http.Header) {
		t.Helper()
		s, body, hdr := call(t, ts, "GET", q, "")
		if s != 200 {
			t.Fatalf("%s: %d %s", q, s, body)
		}
		var l []listedJSON
		json.Unmarshal([]byte(body), &l)
		return l, hdr
	}
	// The JS SDK: each key and value escaped, then the pairs as a query.
	enc := func(m map[string]string) string {
		v := url.Values{}
		for k, x := range m {
			v.Set(url.QueryEscape(k), url.QueryEscape(x))
		}
		return url.QueryEscape(v.Encode())
	}
	if l, _ := list("/v2/sandboxes?metadata=" + enc(map[string]string{"job": "0", "team": "a b&c=d"})); len(l) != 3 {
		t.Errorf("metadata job=0: %d sandboxes", len(l))
	}
	if l, _ := list("/v2/sandboxes?state=paused"); len(l) != 1 || l[0].SandboxID != ids[4] || l[0].State != "paused" {
		t.Errorf("state paused: %+v", l)
	}
	if l, _ := list("/sandboxes"); len(l) != 4 {
		t.Errorf("v1 list: %d sandboxes, want the 4 running", len(l))
	}
	var all []string
	q := "/v2/sandboxes?limit=2"
	for range 4 {
		l, hdr := list(q)
		for _, x := range l {
			all = append(all, x.SandboxID)
		}
		if hdr.Get("X-Next-Token") == "" {
			break
		}
		q = "/v2/sandboxes?limit=2&nextToken=" + url.QueryEscape(hdr.Get("X-Next-Token"))
	}
	if len(all) != 5 || all[0] != ids[4] || all[4] != ids[0] {
		t.Errorf("pages, newest first: %v (made %v)", all, ids)
	}
}

// An RPC refused on the host is a Connect error: for a stream (the SDK's
// commands.run), a stream of one end frame whose error says why, so that
// the SDK raises its AuthenticationError, or shows that the sandbox is
// paused, instead of a bare HTTP status.
func TestConnectErrors(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	endFrame := func(what, body, code string) {
		t.Helper()
		if len(body) < 5 || body[0] != 2 || int(body[1])<<24|int(body[2])<<16|int(body[3])<<8|int(body[4]) != len(body)-5 {
			t.Fatalf("%s: not one Connect end frame: %q", what, body)
		}
		var end struct {
			Error struct{ Code, Message string }
		}
		if err := json.Unmarshal([]byte(body[5:]), &end); err != nil || end.Error.Code != code || end.Error.Message == "" {
			t.Errorf("%s: end frame %s, want code %s", what, body[5:], code)
		}
	}
	stream := []string{"E2b-Sandbox-Id: " + a.ID, "Content-Type: application/connect+json", "Connect-Protocol-Version: 1"}
	s, body, hdr := call(t, ts, "POST", "/process.Process/Start", "\x00\x00\x00\x00\x02{}", append(stream, "X-Access-Token: wrong")...)
	if s != 200 || hdr.Get("Content-Type") != "application/connect+json" {
		t.Errorf("a stream with a wrong token: %d %v", s, hdr)
	}
	endFrame("a stream with a wrong token", body, "unauthenticated")
	call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{}`)
	s, body, _ = call(t, ts, "POST", "/process.Process/Start", "\x00\x00\x00\x00\x02{}", append(stream, "X-Access-Token: "+a.Token)...)
	if s != 200 {
		t.Errorf("a stream to a paused sandbox: %d", s)
	}
	endFrame("a stream to a paused sandbox", body, "failed_precondition")
	s, body, _ = call(t, ts, "POST", "/filesystem.Filesystem/Stat", `{"path":"/"}`, "E2b-Sandbox-Id: "+a.ID, "X-Access-Token: "+a.Token, "Content-Type: application/json")
	var e struct{ Code, Message string }
	if s != 409 || json.Unmarshal([]byte(body), &e) != nil || e.Code != "failed_precondition" {
		t.Errorf("a unary call to a paused sandbox: %d %s", s, body)
	}
	if n := len(h.seen(a.ID)); n != 0 {
		t.Errorf("%d refused RPCs reached the box", n)
	}
}

// getHost of a sandbox made with network.allowPublicTraffic false wants
// its traffic token; envd's port does not.
func TestTrafficToken(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm","network":{"allowPublicTraffic":false}}`)
	tok, _ := a.JSON["trafficAccessToken"].(string)
	if tok == "" {
		t.Fatalf("no trafficAccessToken: %v", a.JSON)
	}
	host := "Host: 8000-" + a.ID + "." + testDomain
	s, body, _ := call(t, ts, "GET", "/", "", host, "X-API-Key: ")
	errorShape(t, "a port without the traffic token", s, body, 403)
	if s, body, _ := call(t, ts, "GET", "/", "", host, "X-API-Key: ", "E2b-Traffic-Access-Token: "+tok); s != 200 {
		t.Errorf("a port with the traffic token: %d %s", s, body)
	}
	for _, r := range h.seen(a.ID) {
		if r.Header.Get("E2b-Traffic-Access-Token") != "" {
			t.Errorf("the traffic token reached the box")
		}
	}
	b := create(t, ts, `{"templateID":"warm"}`)
	if s, body, _ := call(t, ts, "GET", "/", "", "Host: 8000-"+b.ID+"."+testDomain, "X-API-Key: "); s != 200 {
		t.Errorf("a public port: %d %s", s, body)
	}
}

// lifecycle onTimeout pause: the box's deadline suspends it (the host's
// reapers do, serve or not); with autoResume, a request for the paused
// sandbox resumes it, with its timeout again, and goes through.
func TestAutoPauseAndResume(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm","timeout":120,"autoPause":true,"autoResume":{"enabled":true}}`)
	b := create(t, ts, `{"templateID":"warm","autoPause":true}`)
	for _, id := range []string{a.ID, b.ID} {
		if bx, _ := h.Box(context.Background(), id); !bx.SuspendAtExpiry {
			t.Errorf("sandbox %s: its box's deadline does not suspend it", id)
		}
	}
	_, body, _ := call(t, ts, "GET", "/sandboxes/"+a.ID, "")
	if !strings.Contains(body, `"lifecycle":{"autoResume":true,"onTimeout":"pause"}`) {
		t.Errorf("a's lifecycle: %s", body)
	}
	// Their deadlines pass: the host suspends them and takes the deadline
	// away.
	for _, id := range []string{a.ID, b.ID} {
		h.Suspend(context.Background(), id)
		h.SetExpires(context.Background(), id, nil)
	}
	s, body, _ := call(t, ts, "GET", "/envs", "", "E2b-Sandbox-Id: "+b.ID, "X-Access-Token: "+b.Token)
	errorShape(t, "a paused sandbox without autoResume", s, body, 409)
	if s, body, _ := call(t, ts, "GET", "/envs", "", "E2b-Sandbox-Id: "+a.ID, "X-Access-Token: "+a.Token); s != 200 {
		t.Fatalf("a request for a paused autoResume sandbox: %d %s", s, body)
	}
	if d := deadline(t, h, a.ID); d != 2*time.Minute {
		t.Errorf("an auto-resumed sandbox's deadline: %s, want its timeout", d)
	}
	// A wrong token resumes nothing.
	h.Suspend(context.Background(), a.ID)
	s, body, _ = call(t, ts, "GET", "/envs", "", "E2b-Sandbox-Id: "+a.ID, "X-Access-Token: wrong")
	errorShape(t, "a wrong token for a paused autoResume sandbox", s, body, 401)
	if bx, _ := h.Box(context.Background(), a.ID); bx.State != Suspended {
		t.Errorf("a request with a wrong token resumed the sandbox")
	}
}

// getHost's URL carries a WebSocket: the upgrade goes through to the
// sandbox's port, and bytes go both ways after it.
func TestWebSocketByHost(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	c, err := net.Dial("tcp", ts.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Minute))
	fmt.Fprintf(c, "GET /ws HTTP/1.1\r\nHost: 8000-%s.%s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", a.ID, testDomain)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("the upgrade: %d %s", resp.StatusCode, b)
	}
	for _, msg := range []string{"ping", "pong"} {
		c.Write([]byte(msg))
		got := make([]byte, len(a.ID)+1+len(msg))
		if _, err := io.ReadFull(br, got); err != nil {
			t.Fatal(err)
		}
		if string(got) != a.ID+":"+msg {
			t.Errorf("after the upgrade: %q", got)
		}
	}
}

// The code interpreter's port runs code as the sandbox's user: a cell
// (POST /execute) wants the sandbox's access token, whatever else the port
// lets through; a wrong token is refused on its other paths too; nothing
// refused reaches the box, and the token never does.
func TestCodeInterpreterWantsTheToken(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	b := create(t, ts, `{"templateID":"warm"}`)
	h.mu.Lock()
	h.boxes[a.ID].openPorts["127.0.0.1:49999"] = true
	h.mu.Unlock()
	route := []string{"E2b-Sandbox-Id: " + a.ID, "E2b-Sandbox-Port: 49999"}
	for _, tc := range []struct {
		name, method, path string
		headers            []string
		want               int
	}{
		{"a cell without the token", "POST", "/execute", nil, 401},
		{"a cell with another sandbox's token", "POST", "/execute", []string{"X-Access-Token: " + b.Token}, 401},
		{"a context with a wrong token", "POST", "/contexts", []string{"X-Access-Token: " + b.Token}, 401},
		{"a cell with the token", "POST", "/execute", []string{"X-Access-Token: " + a.Token}, 200},
		{"a context without a token (SDKs before contexts' authentication)", "POST", "/contexts", nil, 200},
		{"health", "GET", "/health", nil, 200},
	} {
		before := len(h.seen(a.ID))
		status, body, _ := call(t, ts, tc.method, tc.path, `{"code":"1"}`, append(route, tc.headers...)...)
		if status != tc.want {
			t.Errorf("%s: %d %s, want %d", tc.name, status, body, tc.want)
		}
		if reached := len(h.seen(a.ID)) > before; reached != (tc.want == 200) {
			t.Errorf("%s: reached the box %v", tc.name, reached)
		}
	}
	for _, r := range h.seen(a.ID) {
		if r.Header.Get("X-Access-Token") != "" {
			t.Errorf("the access token reached the box on %s %s", r.Method, r.Path)
		}
	}
	// Another port of the sandbox is public, as E2B's are by default.
	if status, body, _ := call(t, ts, "POST", "/execute", "{}", "E2b-Sandbox-Id: "+a.ID, "E2b-Sandbox-Port: 8000"); status != 200 {
		t.Errorf("port 8000's /execute: %d %s", status, body)
	}
}

// network.allowOut and denyOut are the sandbox's egress policy from its
// clone's first frame (allowInternetAccess false with rules: deny-all plus
// them); PUT /sandboxes/{id}/network replaces the whole policy of the
// running sandbox; what kvbox cannot enforce is refused, nothing half done.
func TestNetworkPolicy(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm","network":{"allowOut":["api.example.com","*.github.com"],"denyOut":["0.0.0.0/0"]}}`)
	b := create(t, ts, `{"templateID":"warm","allow_internet_access":false,"network":{"allowOut":["198.51.100.7"]}}`)
	c := create(t, ts, `{"templateID":"warm","allow_internet_access":false}`)
	d := create(t, ts, `{"templateID":"warm"}`)
	policy := func(id string) *egress.Policy {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.boxes[id].egress
	}
	box := func(id string) Box {
		bx, err := h.Box(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		return bx
	}
	if p := policy(a.ID); p == nil || !slices.Equal(p.Allow, []string{"api.example.com", "*.github.com"}) || !slices.Equal(p.Deny, []string{"0.0.0.0/0"}) || box(a.ID).NoInternet {
		t.Errorf("a's policy %+v (no internet %v)", p, box(a.ID).NoInternet)
	}
	if p := policy(b.ID); p == nil || !slices.Equal(p.Allow, []string{"198.51.100.7/32"}) || !slices.Equal(p.Deny, []string{"0.0.0.0/0"}) || box(b.ID).NoInternet {
		t.Errorf("b's policy (allowInternetAccess false with a rule) %+v", p)
	}
	if policy(c.ID) != nil || !box(c.ID).NoInternet || policy(d.ID) != nil || box(d.ID).NoInternet {
		t.Errorf("c (no internet, no rule) or d (nothing): %+v %+v", policy(c.ID), policy(d.ID))
	}

	put := func(id, body string) (int, string) {
		status, out, _ := call(t, ts, "PUT", "/sandboxes/"+id+"/network", body)
		return status, out
	}
	if status, out := put(a.ID, `{"allowOut":["codeload.github.com"],"denyOut":["0.0.0.0/0"]}`); status != 204 {
		t.Fatalf("update a: %d %s", status, out)
	}
	if p := policy(a.ID); p == nil || !slices.Equal(p.Allow, []string{"codeload.github.com"}) {
		t.Errorf("a's policy after the update %+v, want only codeload.github.com allowed", p)
	}
	if status, out := put(d.ID, `{"allow_internet_access":false}`); status != 204 {
		t.Fatalf("update d: %d %s", status, out)
	}
	if p := policy(d.ID); p == nil || !slices.Equal(p.Deny, []string{"0.0.0.0/0"}) || len(p.Allow) != 0 {
		t.Errorf("d's policy after allowInternetAccess false %+v", p)
	}
	if status, out := put(d.ID, `{}`); status != 204 || policy(d.ID) == nil || !policy(d.ID).IsZero() {
		t.Errorf("d's policy after an empty update (no rule: allow all): %d %s %+v", status, out, policy(d.ID))
	}
	before := *policy(a.ID)
	for name, body := range map[string]string{
		"a name denied (names only allow)": `{"denyOut":["evil.example.com"]}`,
		"header rules":                     `{"rules":{"x.example.com":{"transform":{"headers":{"A":"b"}}}}}`,
		"not JSON":                         `{`,
	} {
		if status, out := put(a.ID, body); status != 400 {
			t.Errorf("update a, %s: %d %s, want 400", name, status, out)
		}
	}
	if p := policy(a.ID); !slices.Equal(p.Allow, before.Allow) || !slices.Equal(p.Deny, before.Deny) {
		t.Errorf("a refused update changed a's policy: %+v", p)
	}
	if status, out := put(c.ID, `{"allowOut":["198.51.100.7"],"denyOut":["0.0.0.0/0"]}`); status != 409 {
		t.Errorf("update of a sandbox with no route out: %d %s, want 409", status, out)
	}
	if status, out := put("nosuchsandbox0000000", `{}`); status != 404 {
		t.Errorf("update of an unknown sandbox: %d %s, want 404", status, out)
	}
}
