package serve

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"kvbox.dev/kvbox/guest-agent/envd"
)

// What E2B's own SDK suites expect of a sandbox, found by running them
// against kvbox serve.

// A paused sandbox's envd health is a 502, which the SDKs' isRunning reads
// as false (a 409 made it raise); its other paths stay a 409 that says it
// is paused, and an auto-resume sandbox's health resumes it as any request.
func TestPausedHealthIsNotRunning(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	health := func(id string) (int, string) {
		s, b, _ := call(t, ts, "GET", "/health", "", "E2b-Sandbox-Id: "+id, "X-API-Key: ")
		return s, b
	}
	if s, b := health(a.ID); s != 200 {
		t.Fatalf("a running sandbox's health: %d %s", s, b)
	}
	if s, b, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{}`); s != 204 {
		t.Fatalf("pause: %d %s", s, b)
	}
	s, b := health(a.ID)
	errorShape(t, "a paused sandbox's health", s, b, 502)
	if !strings.Contains(b, "paused") {
		t.Errorf("a paused sandbox's health does not say it is paused: %s", b)
	}
	s, b, _ = call(t, ts, "GET", "/envs", "", "E2b-Sandbox-Id: "+a.ID, "X-Access-Token: "+a.Token)
	errorShape(t, "a paused sandbox's /envs", s, b, 409)
	if n := h.boxes[a.ID].resumeCalls; n != 0 {
		t.Errorf("a paused sandbox was resumed %d times by health checks", n)
	}

	r := create(t, ts, `{"templateID":"warm","autoResume":{"enabled":true}}`)
	call(t, ts, "POST", "/sandboxes/"+r.ID+"/pause", `{}`)
	if s, b := health(r.ID); s != 200 {
		t.Errorf("an auto-resume sandbox's health: %d %s, want it resumed", s, b)
	}
}

// startedAfter lists the sandboxes started at or after it (E2B's >=).
func TestListStartedAfterIsInclusive(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	b := create(t, ts, `{"templateID":"warm"}`)
	at := h.boxes[b.ID].Created.Format(time.RFC3339Nano)
	s, body, _ := call(t, ts, "GET", "/v2/sandboxes?startedAfter="+url.QueryEscape(at), "")
	if s != 200 {
		t.Fatalf("list: %d %s", s, body)
	}
	var l []listedJSON
	json.Unmarshal([]byte(body), &l)
	if len(l) != 1 || l[0].SandboxID != b.ID {
		t.Errorf("startedAfter %s (b's start; a started before): %+v, want only b %s (a is %s)", at, l, b.ID, a.ID)
	}
}

// An expired signed URL is refused with envd's message.
func TestExpiredSignatureMessage(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	exp := time.Now().Add(-time.Minute).Unix()
	q := url.Values{"path": {"/tmp/x"}, "signature": {envd.Signature("/tmp/x", "read", "", a.Token, exp)},
		"signature_expiration": {strconv.FormatInt(exp, 10)}}
	// With the routing headers, and as the SDKs' downloadUrl has it:
	// without, the signature telling the sandbox.
	for what, hdr := range map[string]string{"routed by its headers": "E2b-Sandbox-Id: " + a.ID, "routed by its signature": "X-Other: x"} {
		s, body, _ := call(t, ts, "GET", "/files?"+q.Encode(), "", "X-API-Key: ", hdr)
		var e errorJSON
		if json.Unmarshal([]byte(body), &e); s != 401 || e.Code != 401 || e.Message != "signature is already expired" {
			t.Errorf("an expired signature, %s: %d %s, want 401 {code: 401, message: \"signature is already expired\"}", what, s, body)
		}
	}
	// A signature no sandbox made says only that.
	q.Set("signature", envd.Signature("/tmp/x", "read", "", "f00d", exp))
	if s, body, _ := call(t, ts, "GET", "/files?"+q.Encode(), "", "X-API-Key: "); s != 401 || strings.Contains(body, "expired") {
		t.Errorf("an expired signature of no sandbox's token: %d %s", s, body)
	}
}

// A sandbox's timeout counts from when it is ready: one shorter than its
// clone takes is created, not stopped by its reaper while it boots, and
// has its whole timeout once ready.
func TestTimeoutCountsFromReady(t *testing.T) {
	h := newFakeHost()
	h.cloneTakes = 2 * time.Minute
	_, ts := newTestServer(t, h, "")
	s, body, _ := call(t, ts, "POST", "/v2/sandboxes", `{"templateID":"warm","timeout":5}`, "Content-Type: application/json")
	if s != http.StatusCreated {
		t.Fatalf("create with a timeout shorter than the clone: %d %s", s, body)
	}
	var sb sandboxJSON
	json.Unmarshal([]byte(body), &sb)
	b, err := h.Box(context.Background(), sb.SandboxID)
	if err != nil {
		t.Fatal(err)
	}
	if b.Expires == nil || time.Until(*b.Expires) > 5*time.Second {
		t.Errorf("the sandbox's deadline %v is not its timeout from when it was ready", b.Expires)
	}
}
