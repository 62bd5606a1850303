package serve

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"kvbox.dev/kvbox/egress"
)

// fakeHost is a Host in memory: boxes are records, and each box answers
// streams with an HTTP server that records what reached it.
type fakeHost struct {
	mu        sync.Mutex
	boxes     map[string]*fakeBox
	snaps     map[string]Snapshot
	failClone map[string]error // by snapshot name
	clones    int
	calls     []string
	disk      int64             // of the next clones (0: 8 GiB)
	envd      map[string]string // each clone's envd configuration, as JSON
	failNth   int               // the clone of this number fails
	// open counts the streams Dial made that serve has not closed.
	open int
	// handlers answer a target's requests instead of the echo.
	handlers map[string]http.HandlerFunc
	// cloneTakes is how long a clone takes: a clone whose deadline comes
	// sooner is stopped by its reaper while it boots, and fails.
	cloneTakes time.Duration
	// secrets is the host's egress secret store.
	secrets map[string]string
	// gates hold the calls of an operation ("clone", "suspend", ...) in
	// the middle (gate).
	gates map[string]*fakeGate
	// removes counts each box's removals that found it.
	removes map[string]int
	// failBoot and failStop fail the next Boot and Stop.
	failBoot, failStop error
}

// fakeGate holds each call of an operation after it starts: entered gets
// the box's name, and the call goes on once release is closed.
type fakeGate struct {
	entered chan string
	release chan struct{}
}

// gate makes op's calls wait in the middle until the returned gate's
// release is closed.
func (h *fakeHost) gate(op string) *fakeGate {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.gates == nil {
		h.gates = map[string]*fakeGate{}
	}
	g := &fakeGate{entered: make(chan string, 100), release: make(chan struct{})}
	h.gates[op] = g
	return g
}

// hold waits at op's gate, if it has one; the caller holds no lock.
func (h *fakeHost) hold(op, name string) {
	h.mu.Lock()
	g := h.gates[op]
	h.mu.Unlock()
	if g != nil {
		g.entered <- name
		<-g.release
	}
}

type fakeBox struct {
	Box
	seen        []seenReq // requests that reached the box, any target
	openPorts   map[string]bool
	resumeCalls int
	boots       int            // cold boots (Boot)
	conns       []net.Conn     // its streams, which end with its QEMU
	egress      *egress.Policy // as the clone or SetEgress gave it
}

// seenReq is a request as it reached a box.
type seenReq struct {
	Target, Method, Path, Query string
	Header                      http.Header
}

func newFakeHost() *fakeHost {
	return &fakeHost{boxes: map[string]*fakeBox{}, snaps: map[string]Snapshot{
		"warm": {Name: "warm", Box: "dev", Created: time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)},
	}, failClone: map[string]error{}}
}

func (h *fakeHost) record(format string, a ...any) {
	h.calls = append(h.calls, fmt.Sprintf(format, a...))
}

func (h *fakeHost) Clone(ctx context.Context, req CloneRequest) (Box, error) {
	h.hold("clone", req.Name)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("clone %s %s", req.Snapshot, req.Name)
	if err := h.failClone[req.Snapshot]; err != nil {
		return Box{}, err
	}
	if _, ok := h.snaps[req.Snapshot]; !ok {
		return Box{}, fmt.Errorf("snapshot %q does not exist: %w", req.Snapshot, ErrNotFound)
	}
	if _, ok := h.boxes[req.Name]; ok {
		return Box{}, fmt.Errorf("box %s: %w", req.Name, ErrExists)
	}
	if req.Envd == nil || req.Envd.SandboxID != req.Name {
		return Box{}, fmt.Errorf("clone without an envd configuration: %+v", req.Envd)
	}
	if h.envd == nil {
		h.envd = map[string]string{}
	}
	j, _ := json.Marshal(req.Envd)
	h.envd[req.Name] = string(j)
	h.clones++
	if h.clones == h.failNth {
		return Box{}, fmt.Errorf("clone %s: the agent did not answer", req.Name)
	}
	if req.Expires != nil && req.Expires.Before(time.Now().Add(h.cloneTakes)) {
		return Box{}, fmt.Errorf("box %s stopped while booting: its deadline passed", req.Name)
	}
	if req.Expires != nil {
		t := req.Expires.UTC().Truncate(time.Second)
		req.Expires = &t
	}
	b := &fakeBox{Box: Box{Name: req.Name, UUID: fmt.Sprintf("uuid-%d", h.clones), State: Running, Snapshot: req.Snapshot,
		Created: time.Date(2026, 12, 5, 12, 0, h.clones, 0, time.UTC), Expires: req.Expires, CPUs: 2,
		MemoryBytes: 4 << 30, DiskBytes: cmp.Or(h.disk, 8<<30), Labels: req.Labels, NoInternet: req.NoInternet,
		SuspendAtExpiry: req.SuspendAtExpiry},
		openPorts: map[string]bool{"envd": true, "127.0.0.1:8000": true}, egress: req.Egress}
	h.boxes[req.Name] = b
	return b.Box, nil
}

func (h *fakeHost) get(name string) (*fakeBox, error) {
	b := h.boxes[name]
	if b == nil {
		return nil, fmt.Errorf("box %q does not exist: %w", name, ErrNotFound)
	}
	return b, nil
}

func (h *fakeHost) Remove(ctx context.Context, name string) error {
	h.hold("remove", name)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("remove %s", name)
	b, err := h.get(name)
	if err != nil {
		return err
	}
	for _, c := range b.conns {
		c.Close()
	}
	delete(h.boxes, name)
	if h.removes == nil {
		h.removes = map[string]int{}
	}
	h.removes[name]++
	return nil
}

func (h *fakeHost) Stop(ctx context.Context, name string) error {
	h.hold("stop", name)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("stop %s", name)
	b, err := h.get(name)
	if err != nil {
		return err
	}
	if err := h.failStop; err != nil {
		h.failStop = nil
		return err
	}
	if b.State != Running {
		return fmt.Errorf("box %s is %s: %w", name, b.State, ErrBusy)
	}
	b.State = Stopped
	for _, c := range b.conns {
		c.Close()
	}
	b.conns = nil
	return nil
}

func (h *fakeHost) Boot(ctx context.Context, name string) error {
	h.hold("boot", name)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("boot %s", name)
	b, err := h.get(name)
	if err != nil {
		return err
	}
	if b.State != Stopped {
		return fmt.Errorf("box %s is %s, not stopped: %w", name, b.State, ErrBusy)
	}
	b.State = Running
	b.boots++
	if err := h.failBoot; err != nil {
		// As kvbox start leaves a box whose agent did not answer:
		// running.
		h.failBoot = nil
		return err
	}
	return nil
}

func (h *fakeHost) SetLabels(ctx context.Context, name string, labels map[string]string) (Box, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("labels %s", name)
	b, err := h.get(name)
	if err != nil {
		return Box{}, err
	}
	m := map[string]string{}
	for k, v := range labels {
		m[k] = v
	}
	b.Labels = m
	return b.Box, nil
}

func (h *fakeHost) SetSnapshotExpires(ctx context.Context, name string, at *time.Time) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("snapshot-expires %s", name)
	sn, ok := h.snaps[name]
	if !ok {
		return fmt.Errorf("snapshot %q: %w", name, ErrNotFound)
	}
	sn.Expires = at
	h.snaps[name] = sn
	return nil
}

func (h *fakeHost) Suspend(ctx context.Context, name string) error {
	h.hold("suspend", name)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("suspend %s", name)
	b, err := h.get(name)
	if err != nil {
		return err
	}
	if b.State != Running {
		return fmt.Errorf("box %s is %s: %w", name, b.State, ErrBusy)
	}
	b.State = Suspended
	for _, c := range b.conns {
		c.Close()
	}
	b.conns = nil
	return nil
}

func (h *fakeHost) Resume(ctx context.Context, name string) error {
	h.hold("resume", name)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("resume %s", name)
	b, err := h.get(name)
	if err != nil {
		return err
	}
	if b.State != Suspended {
		return fmt.Errorf("box %s is %s: %w", name, b.State, ErrBusy)
	}
	b.State = Running
	b.resumeCalls++
	return nil
}

func (h *fakeHost) SetSecret(name string, value []byte) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := egress.ValidSecretName(name); err != nil {
		return fmt.Errorf("%v: %w", err, ErrInvalid)
	}
	if h.secrets == nil {
		h.secrets = map[string]string{}
	}
	h.secrets[name] = string(value)
	return nil
}

func (h *fakeHost) RemoveSecret(name string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.secrets[name]; !ok {
		return fmt.Errorf("no secret %q: %w", name, ErrNotFound)
	}
	delete(h.secrets, name)
	return nil
}

// storeOf is a copy of the host's secret store.
func (h *fakeHost) storeOf() map[string]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return maps.Clone(h.secrets)
}

func (h *fakeHost) SetEgress(ctx context.Context, name string, p egress.Policy) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("egress %s allow %v deny %v", name, p.Allow, p.Deny)
	b, err := h.get(name)
	if err != nil {
		return err
	}
	b.egress = &p
	return nil
}

func (h *fakeHost) SetExpires(ctx context.Context, name string, at *time.Time) (Box, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("expires %s %v", name, at != nil)
	b, err := h.get(name)
	if err != nil {
		return Box{}, err
	}
	if at != nil {
		t := at.UTC().Truncate(time.Second)
		at = &t
	}
	b.Expires = at
	return b.Box, nil
}

func (h *fakeHost) Boxes(ctx context.Context) ([]Box, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []Box
	for _, b := range h.boxes {
		out = append(out, b.Box)
	}
	return out, nil
}

func (h *fakeHost) Box(ctx context.Context, name string) (Box, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	b, err := h.get(name)
	if err != nil {
		return Box{}, err
	}
	return b.Box, nil
}

func (h *fakeHost) Snapshot(ctx context.Context, box, name string, expires *time.Time) (Snapshot, error) {
	h.hold("snapshot", box)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.record("snapshot %s %s", box, name)
	if _, err := h.get(box); err != nil {
		return Snapshot{}, err
	}
	if _, ok := h.snaps[name]; ok {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", name, ErrExists)
	}
	sn := Snapshot{Name: name, Box: box, Created: time.Date(2026, 12, 5, 13, 0, len(h.snaps), 0, time.UTC), Expires: expires}
	h.snaps[name] = sn
	return sn, nil
}

func (h *fakeHost) Snapshots(ctx context.Context) ([]Snapshot, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []Snapshot
	for _, s := range h.snaps {
		out = append(out, s)
	}
	return out, nil
}

func (h *fakeHost) RemoveSnapshot(ctx context.Context, name string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.snaps[name]; !ok {
		return fmt.Errorf("snapshot %q: %w", name, ErrNotFound)
	}
	for _, b := range h.boxes {
		if b.Snapshot == name {
			return fmt.Errorf("snapshot %q has clones: %w", name, ErrBusy)
		}
	}
	delete(h.snaps, name)
	return nil
}

// Dial serves the stream with an HTTP server of the box's, which records
// each request and answers with its target.
func (h *fakeHost) Dial(ctx context.Context, name, target string) (net.Conn, error) {
	h.mu.Lock()
	b, err := h.get(name)
	if err == nil && b.State != Running {
		err = fmt.Errorf("box %s is %s: %w", name, b.State, ErrBusy)
	}
	if err == nil && !b.openPorts[target] {
		err = fmt.Errorf("dial %s: connection refused", target)
	}
	h.mu.Unlock()
	if err != nil {
		return nil, err
	}
	c1, c2 := net.Pipe()
	h.mu.Lock()
	b.conns = append(b.conns, c2)
	h.open++
	h.mu.Unlock()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.mu.Lock()
		hf := h.handlers[target]
		h.mu.Unlock()
		if hf != nil {
			hf(w, r)
			return
		}
		if strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
			// A server that switches protocols, then echoes what it
			// is sent, prefixed with the box's name.
			c, rw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				return
			}
			defer c.Close()
			rw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
			rw.Flush()
			buf := make([]byte, 512)
			for {
				n, err := rw.Read(buf)
				if err != nil {
					return
				}
				c.Write(append([]byte(name+":"), buf[:n]...))
			}
		}
		io.Copy(io.Discard, r.Body)
		h.mu.Lock()
		b.seen = append(b.seen, seenReq{Target: target, Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Header: r.Header.Clone()})
		h.mu.Unlock()
		w.Header().Set("X-Box", name)
		fmt.Fprintf(w, "%s %s %s", name, target, r.URL.Path)
	}), ErrorLog: log.New(io.Discard, "", 0)}
	go srv.Serve(&oneConn{c: c2})
	return &fakeStream{Conn: c1, h: h}, nil
}

// fakeStream is serve's end of a stream.
type fakeStream struct {
	net.Conn
	h    *fakeHost
	once sync.Once
}

func (c *fakeStream) Close() error {
	c.once.Do(func() {
		c.h.mu.Lock()
		c.h.open--
		c.h.mu.Unlock()
	})
	return c.Conn.Close()
}

// openStreams is how many streams serve holds open.
func (h *fakeHost) openStreams() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.open
}

// handle makes target's requests go to hf, in every box.
func (h *fakeHost) handle(target string, hf http.HandlerFunc) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.handlers == nil {
		h.handlers = map[string]http.HandlerFunc{}
	}
	h.handlers[target] = hf
}

// openPort opens target in box name.
func (h *fakeHost) openPort(name, target string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.boxes[name].openPorts[target] = true
}

// eventually waits for cond, failing the test with what after a deadline
// that only a stuck run reaches.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// oneConn is a listener of one connection.
type oneConn struct {
	mu   sync.Mutex
	c    net.Conn
	done chan struct{}
}

func (l *oneConn) Accept() (net.Conn, error) {
	l.mu.Lock()
	c := l.c
	l.c = nil
	if l.done == nil {
		l.done = make(chan struct{})
	}
	done := l.done
	l.mu.Unlock()
	if c != nil {
		return c, nil
	}
	<-done
	return nil, net.ErrClosed
}

func (l *oneConn) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done == nil {
		l.done = make(chan struct{})
	}
	select {
	case <-l.done:
	default:
		close(l.done)
	}
	return nil
}

func (l *oneConn) Addr() net.Addr { return &net.UnixAddr{Name: "box", Net: "unix"} }

// stop stops a box as its QEMU ending would: its streams end.
func (h *fakeHost) stop(name string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	b := h.boxes[name]
	b.State = Stopped
	for _, c := range b.conns {
		c.Close()
	}
	b.conns = nil
}

// seen is what reached box name.
func (h *fakeHost) seen(name string) []seenReq {
	h.mu.Lock()
	defer h.mu.Unlock()
	if b := h.boxes[name]; b != nil {
		return append([]seenReq(nil), b.seen...)
	}
	return nil
}

const testKey = "e2b_0123456789abcdef0123456789abcdef01234567"
const testDomain = "kvbox.localhost:3049"

// newTestServer is a Server over a fake host, and its listener; opts
// change its configuration.
func newTestServer(t *testing.T, h *fakeHost, dir string, opts ...func(*Config)) (*Server, *httptest.Server) {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	cfg := Config{Host: h, APIKey: testKey, Domain: testDomain, SecretsDir: dir, Log: log.New(io.Discard, "", 0)}
	for _, o := range opts {
		o(&cfg)
	}
	s, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s)
	t.Cleanup(func() { ts.Close(); s.Close() })
	return s, ts
}

// call makes a request to ts with the API key and headers (name: value),
// and returns the status and body.
func call(t *testing.T, ts *httptest.Server, method, path, body string, headers ...string) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequest(method, ts.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-API-Key", testKey)
	for _, h := range headers {
		k, v, _ := strings.Cut(h, ": ")
		if k == "Host" {
			req.Host = v
			continue
		}
		if v == "" {
			req.Header.Del(k)
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}
