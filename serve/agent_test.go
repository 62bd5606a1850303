package serve

import (
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"

	agent "kvbox.dev/kvbox/guest-agent"
)

// agentHost is a fakeHost whose streams go as kvbox's do: through a real
// agent (in process, over a socket pair), each stream's host end one end
// of a unix socket pair (kvbox.Host.Dial), to servers on loopback that
// stand for the box's ports.
type agentHost struct {
	*fakeHost
	f     *agent.Forwarder
	ports map[string]string // target: loopback address
}

func newAgentHost(t *testing.T) *agentHost {
	t.Helper()
	hc, gc, err := agent.SocketPair()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	srv := &agent.Server{Log: log.New(io.Discard, "", 0), EnvdAddr: "-"}
	go func() {
		defer close(done)
		srv.ServeConn(ctx, gc)
	}()
	f, err := agent.NewClient(hc).Forward(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Close()
		cancel()
		<-done
	})
	return &agentHost{fakeHost: newFakeHost(), f: f, ports: map[string]string{}}
}

// serve makes target's requests go to hf, on a loopback listener.
func (h *agentHost) serve(t *testing.T, target string, hf http.HandlerFunc) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: hf, ErrorLog: log.New(io.Discard, "", 0)}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ports[target] = l.Addr().String()
}

func (h *agentHost) Dial(ctx context.Context, name, target string) (net.Conn, error) {
	h.mu.Lock()
	addr, ok := h.ports[target]
	h.mu.Unlock()
	if !ok {
		return h.fakeHost.Dial(ctx, name, target)
	}
	mine, theirs, err := agent.SocketPair()
	if err != nil {
		return nil, err
	}
	if _, err := h.f.Connect(ctx, addr, theirs); err != nil {
		mine.Close()
		theirs.Close()
		return nil, err
	}
	return mine, nil
}

// Through a real agent: requests to a sandbox's port whose clients go
// while the box holds them (it never answers, nor closes its side) leave
// no stream behind in the agent: more of them than the agent carries at
// once all reach the box, and another port is served after them. (Their
// streams used to stay half-open, so the agent's cap soon refused every
// dial: 502.)
func TestClientsThatGoLeaveNoStreamsInTheAgent(t *testing.T) {
	h := newAgentHost(t)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	var held atomic.Int32
	h.serve(t, "127.0.0.1:8000", func(w http.ResponseWriter, r *http.Request) {
		held.Add(1)
		<-release
	})
	h.serve(t, "127.0.0.1:8001", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "answered") })
	_, ts := newTestServer(t, h.fakeHost, "", func(c *Config) { c.Host = h })
	sb := create(t, ts, `{"templateID":"warm"}`)
	// More than the agent's whole cap, one after another.
	const n = 300
	for i := range n {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			resp, err := http.DefaultClient.Do(portRequest(t, ctx, ts.URL, sb.ID, 8000))
			if err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				err = fmt.Errorf("%d %s", resp.StatusCode, b)
			}
			done <- err
		}()
		eventually(t, "request "+strconv.Itoa(i)+" reaches the box", func() bool {
			select {
			case err := <-done:
				t.Fatalf("request %d was answered instead of held: %v", i, err)
			default:
			}
			return held.Load() == int32(i+1)
		})
		cancel()
		<-done
	}
	status, body, _ := call(t, ts, "GET", "/", "", hdrSandboxID+": "+sb.ID, hdrSandboxPort+": 8001")
	if status != http.StatusOK || body != "answered" {
		t.Errorf("a port after %d clients went: %d %s", n, status, body)
	}
}
