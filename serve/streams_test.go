package serve

import (
	"context"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
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
