package serve

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"kvbox.dev/kvbox/guest-agent/envd"
)

// holdRequests makes target's requests wait, in every box, without a word
// and whatever their client does, until the test ends: a box that keeps
// its side open. held counts those that came.
func holdRequests(t *testing.T, h *fakeHost, target string) (held *atomic.Int32) {
	held = new(atomic.Int32)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	h.handle(target, func(w http.ResponseWriter, r *http.Request) {
		held.Add(1)
		<-release
	})
	return held
}

// portRequest is a data-plane request for port of sandbox id, by the
// routing headers.
func portRequest(t *testing.T, ctx context.Context, ts string, id string, port int) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, "GET", ts+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(hdrSandboxID, id)
	req.Header.Set(hdrSandboxPort, strconv.Itoa(port))
	return req
}

// A request's stream through the box's agent ends with the request: serve
// keeps none open once a request to a sandbox's port is answered (the
// box's server would keep it alive), nor once the client went before the
// answer (the box holds its side open), however many ports were asked.
func TestStreamsEndWithTheirRequests(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	sb := create(t, ts, `{"templateID":"warm"}`)
	const n = 40
	for p := range n {
		h.openPort(sb.ID, "127.0.0.1:"+strconv.Itoa(9000+p))
	}
	for p := range n {
		status, body, _ := call(t, ts, "GET", "/", "", hdrSandboxID+": "+sb.ID, hdrSandboxPort+": "+strconv.Itoa(9000+p))
		if status != http.StatusOK {
			t.Fatalf("port %d: %d %s", 9000+p, status, body)
		}
	}
	eventually(t, "no stream open once every request was answered", func() bool { return h.openStreams() == 0 })

	held := holdRequests(t, h, "127.0.0.1:8000")
	for i := range n {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			if resp, err := http.DefaultClient.Do(portRequest(t, ctx, ts.URL, sb.ID, 8000)); err == nil {
				resp.Body.Close()
			}
		}()
		eventually(t, "the box holds the request", func() bool { return held.Load() == int32(i+1) })
		cancel()
		<-done
	}
	eventually(t, "no stream open once every client went", func() bool { return h.openStreams() == 0 })
}

// A sandbox's ports but envd's hold at most PortRequests requests in
// flight: past them serve answers 503 with E2B's JSON at once, while the
// owner's envd, and another sandbox's ports, are served as before; a
// request that ends gives its slot back.
func TestPortRequestsBounded(t *testing.T) {
	const limit = 3
	h := newFakeHost()
	_, ts := newTestServer(t, h, "", func(c *Config) { c.PortRequests = limit })
	sb := create(t, ts, `{"templateID":"warm"}`)
	other := create(t, ts, `{"templateID":"warm"}`)
	h.openPort(sb.ID, "127.0.0.1:9000")
	h.openPort(other.ID, "127.0.0.1:9000")
	held := holdRequests(t, h, "127.0.0.1:9000")
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	var done []chan struct{}
	for range limit {
		d := make(chan struct{})
		done = append(done, d)
		go func() {
			defer close(d)
			if resp, err := http.DefaultClient.Do(portRequest(t, ctx, ts.URL, sb.ID, 9000)); err == nil {
				resp.Body.Close()
			}
		}()
	}
	eventually(t, "the box holds the first requests", func() bool { return held.Load() == limit })

	// Past the bound: 503, without waiting for the held ones (the
	// request's deadline is only for a serve that would wait).
	answer := func(id string, port int) (int, string) {
		t.Helper()
		rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer rcancel()
		req := portRequest(t, rctx, ts.URL, id, port)
		if port == envd.Port {
			req.URL.Path = "/envs"
			req.Header.Set(hdrAccessToken, sb.Token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("sandbox %s port %d beside %d held requests: %v", id, port, limit, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	status, body := answer(sb.ID, 9000)
	errorShape(t, "a request past the bound", status, body, http.StatusServiceUnavailable)
	if status, body := answer(sb.ID, envd.Port); status != http.StatusOK {
		t.Errorf("the owner's envd beside the full ports: %d %s", status, body)
	}
	if status, body := answer(sb.ID, 8000); status != http.StatusServiceUnavailable {
		t.Errorf("another port of the same sandbox: %d %s, want 503", status, body)
	}
	h.handle("127.0.0.1:9000", nil)
	if status, body := answer(other.ID, 9000); status != http.StatusOK {
		t.Errorf("another sandbox's port: %d %s", status, body)
	}
	// The held requests' clients go: their slots come back.
	cancel()
	for _, d := range done {
		<-d
	}
	eventually(t, "the slots of requests that ended come back", func() bool {
		status, _ := answer(sb.ID, 8000)
		return status == http.StatusOK
	})
}
