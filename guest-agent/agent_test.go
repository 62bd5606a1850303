package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"kvbox.dev/kvbox/testenv/gate"
)

type fakeSystem struct {
	mu       sync.Mutex
	identity []Identity
	clock    []time.Time
	entropy  [][]byte
	reprobes int
}

func (f *fakeSystem) Capabilities() Capabilities {
	return Capabilities{Identify: true, Clock: true, Entropy: true}
}
func (f *fakeSystem) ApplyIdentity(id Identity) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.identity = append(f.identity, id)
	return nil
}
func (f *fakeSystem) SetClock(t time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.clock = append(f.clock, t)
	return nil
}
func (f *fakeSystem) AddEntropy(b []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.entropy = append(f.entropy, b)
	return nil
}
func (f *fakeSystem) ReprobeBalloon() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reprobes++
	return nil
}

func testServer(t *testing.T) *Server {
	return &Server{System: &fakeSystem{}, Log: log.New(testWriter{t}, "agent: ", 0)}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// socketpair returns two connected unix stream sockets.
func socketpair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	dir := t.TempDir()
	l, err := net.Listen("unix", dir+"/s")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	done := make(chan net.Conn)
	go func() {
		c, _ := l.Accept()
		done <- c
	}()
	a, err := net.Dial("unix", dir+"/s")
	if err != nil {
		t.Fatal(err)
	}
	b := <-done
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// start serves one connection and returns a client on its other end.
func start(t *testing.T, s *Server) *Client {
	t.Helper()
	return serve(t, s, true)
}

// serve serves one connection, trusted (a virtio-serial port) or not (as
// the vsock listener does), and returns a client on its other end.
func serve(t *testing.T, s *Server, trusted bool) *Client {
	t.Helper()
	hc, gc := socketpair(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.serveConn(ctx, gc, trusted)
	}()
	c := NewClient(hc)
	t.Cleanup(func() {
		c.Close()
		cancel()
		<-done
	})
	return c
}

func tctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestPing(t *testing.T) {
	c := start(t, testServer(t))
	in, err := c.Ping(tctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if in.Version != Version || in.Kernel == "" || !in.Capabilities.Exec || !in.Capabilities.Identify {
		t.Errorf("info = %+v", in)
	}
}

func run(t *testing.T, c *Client, req ExecRequest, stdin io.Reader) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code, err := c.Exec(tctx(t), req, stdin, &out, &errb, nil)
	if err != nil {
		t.Fatalf("exec %q: %v", req.Argv, err)
	}
	return out.String(), errb.String(), code
}

func TestExec(t *testing.T) {
	c := start(t, testServer(t))
	tests := []struct {
		name      string
		argv      []string
		stdin     string
		out, errs string
		code      int
	}{
		{"stdout", []string{"echo", "hello"}, "", "hello\n", "", 0},
		{"stderr", []string{"sh", "-c", "echo out; echo err >&2; exit 3"}, "", "out\n", "err\n", 3},
		{"signal", []string{"sh", "-c", "kill -TERM $$"}, "", "", "", 128 + 15},
		{"stdin", []string{"cat"}, "piped\ninput", "piped\ninput", "", 0},
		{"no stdin", []string{"cat"}, "", "", "", 0},
		{"default env", []string{"sh", "-c", "echo $HOME:$PATH; pwd"}, "", "/root:" + defaultPath + "\n/root\n", "", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdin io.Reader
			if tt.stdin != "" {
				stdin = strings.NewReader(tt.stdin)
			}
			out, errs, code := run(t, c, ExecRequest{Argv: tt.argv}, stdin)
			if out != tt.out || errs != tt.errs || code != tt.code {
				t.Errorf("got out=%q err=%q code=%d, want %q %q %d", out, errs, code, tt.out, tt.errs, tt.code)
			}
		})
	}
}

// An exec whose command exits while a background child keeps its
// stdout open and keeps writing to it ends within guestexec.DrainMax of
// the exit, with the command's exit code and what was written until then.
func TestExecBackgroundWriterEnds(t *testing.T) {
	c := start(t, testServer(t))
	dir := t.TempDir()
	argv := []string{"sh", "-c", "sh -c 'echo $$ > " + dir + "/pid; while :; do echo tick; sleep 0.05; done' & sleep 0.3; echo done; exit 4"}
	var out bytes.Buffer
	var code int
	var err error
	waitReturn(t, "Exec", func() { code, err = c.Exec(tctx(t), ExecRequest{Argv: argv}, nil, &out, nil, nil) })
	if pid, rerr := os.ReadFile(dir + "/pid"); rerr == nil {
		exec.Command("kill", strings.TrimSpace(string(pid))).Run()
	}
	if err != nil || code != 4 || !strings.Contains(out.String(), "done\n") || !strings.Contains(out.String(), "tick") {
		t.Fatalf("exec with a writing background child: code %d, err %v, output %q", code, err, out.String())
	}
}

func TestExecNotFound(t *testing.T) {
	c := start(t, testServer(t))
	_, err := c.Exec(tctx(t), ExecRequest{Argv: []string{"no-such-command-kvbox"}}, nil, nil, nil, nil)
	var re *RemoteError
	if !errors.As(err, &re) {
		t.Fatalf("err = %v, want a RemoteError", err)
	}
	// The connection still works.
	if _, _, code := run(t, c, ExecRequest{Argv: []string{"true"}}, nil); code != 0 {
		t.Fatal(code)
	}
}

func TestExecLargeStdinAndOutput(t *testing.T) {
	c := start(t, testServer(t))
	in := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	var out bytes.Buffer
	code, err := c.Exec(tctx(t), ExecRequest{Argv: []string{"cat"}}, bytes.NewReader(in), &out, nil, nil)
	if err != nil || code != 0 {
		t.Fatal(code, err)
	}
	if !bytes.Equal(out.Bytes(), in) {
		t.Fatalf("output differs: %d bytes, want %d", out.Len(), len(in))
	}
}

func TestExecTTY(t *testing.T) {
	gate.File(t, "/dev/ptmx", "pseudo-terminals")
	c := start(t, testServer(t))
	resize := make(chan WinSize, 1)
	pr, pw := io.Pipe()
	var out syncBuffer
	done := make(chan struct{})
	var code int
	var err error
	go func() {
		defer close(done)
		code, err = c.Exec(tctx(t), ExecRequest{Argv: []string{"/bin/sh"}, TTY: true, Rows: 24, Cols: 80}, pr, &out, nil, resize)
	}()
	io.WriteString(pw, "tty; stty size; echo TERM=$TERM\n")
	waitFor(t, &out, "24 80")
	// The resize travels on its own goroutine: ask until the shell sees it.
	resize <- WinSize{Rows: 50, Cols: 132}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(out.String(), "50 132") && time.Now().Before(deadline) {
		io.WriteString(pw, "stty size\n")
		time.Sleep(20 * time.Millisecond)
	}
	io.WriteString(pw, "exit 7\n")
	<-done
	if err != nil || code != 7 {
		t.Fatalf("code=%d err=%v out=%q", code, err, out.String())
	}
	s := out.String()
	for _, want := range []string{"/dev/pts/", "24 80", "50 132", "TERM=" + defaultTerm} {
		if !strings.Contains(s, want) {
			t.Errorf("output %q lacks %q", s, want)
		}
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func waitFor(t *testing.T, b *syncBuffer, want string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(b.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q in %q", want, b.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestCalls(t *testing.T) {
	s := testServer(t)
	s.StateDir = t.TempDir()
	fs := s.System.(*fakeSystem)
	c := start(t, s)
	ctx := tctx(t)
	id := Identity{Hostname: "b2", MAC: "52:54:00:00:00:02", Address: "172.30.0.5/24", Gateway: "172.30.0.1", DNS: []string{"172.30.0.1"}}
	if err := c.Identify(ctx, id); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1700000000, 123)
	if err := c.SetClock(ctx, now); err != nil {
		t.Fatal(err)
	}
	if err := c.AddEntropy(ctx, []byte{1, 2, 3}); err != nil {
		t.Fatal(err)
	}
	if err := c.ReprobeBalloon(ctx); err != nil {
		t.Fatal(err)
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if fs.reprobes != 1 {
		t.Errorf("the system saw %d balloon reprobes, want 1", fs.reprobes)
	}
	if len(fs.identity) != 1 || fs.identity[0].Address != id.Address || len(fs.clock) != 1 || !fs.clock[0].Equal(now) || !bytes.Equal(fs.entropy[0], []byte{1, 2, 3}) {
		t.Errorf("system saw %+v %v %v", fs.identity, fs.clock, fs.entropy)
	}
	got, ok, err := LoadIdentity(s.StateDir)
	if err != nil || !ok || got.Hostname != "b2" {
		t.Errorf("persisted identity = %+v %v %v", got, ok, err)
	}
}

// Reidentify pipelines Identify, SetClock and AddEntropy: all three reach
// the system from one round trip, and the channel still serves calls after
// it. An agent without a system says which of the three failed.
func TestReidentifyPipelined(t *testing.T) {
	s := testServer(t)
	s.StateDir = t.TempDir()
	fs := s.System.(*fakeSystem)
	c := start(t, s)
	ctx := tctx(t)
	id := Identity{Hostname: "b3", MAC: "52:54:00:00:00:03", Address: "172.30.0.6/24", Gateway: "172.30.0.1"}
	now := time.Unix(1700000001, 7)
	if err := c.Reidentify(ctx, id, now, []byte{4, 5, 6}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Ping(ctx); err != nil {
		t.Fatalf("ping after the pipeline: %v", err)
	}
	fs.mu.Lock()
	if len(fs.identity) != 1 || fs.identity[0].Hostname != "b3" || len(fs.clock) != 1 || !fs.clock[0].Equal(now) || !bytes.Equal(fs.entropy[0], []byte{4, 5, 6}) {
		t.Errorf("system saw %+v %v %v", fs.identity, fs.clock, fs.entropy)
	}
	fs.mu.Unlock()

	bare := start(t, &Server{Log: log.New(io.Discard, "", 0)})
	err := bare.Reidentify(ctx, id, now, nil, nil)
	for _, want := range []string{"set the identity", "set the clock", "seed the RNG"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Reidentify on an agent without a system: %v, want it to name %q", err, want)
		}
	}
}

func TestUnsupportedSystem(t *testing.T) {
	c := start(t, &Server{Log: log.New(io.Discard, "", 0)})
	err := c.SetClock(tctx(t), time.Now())
	var re *RemoteError
	if !errors.As(err, &re) {
		t.Fatalf("err = %v", err)
	}
}

// TestStaleBytesBeforeHello: a host that connects to a port after another
// one finds garbage and frames of the old session in the stream.
func TestStaleBytesBeforeHello(t *testing.T) {
	hc, gc := socketpair(t)
	go testServer(t).ServeConn(context.Background(), gc)
	var junk []byte
	junk = append(junk, "random garbage KVB"...)
	junk = append(junk, magic[:]...)
	junk = appendFrame(junk, frameStdin, 99, []byte("old stdin"))
	half := appendFrame(nil, frameRequest, 98, []byte(`{"method":"ping"}`))
	junk = append(junk, half[:len(half)-5]...) // cut short
	junk = appendFrame(junk, frameRequest, 97, []byte(`{"method":"ping"}`))
	marker := t.TempDir() + "/ran"
	junk = appendFrame(junk, frameRequest, 96, []byte(`{"method":"exec","params":{"argv":["touch","`+marker+`"]}}`))
	if _, err := hc.Write(junk); err != nil {
		t.Fatal(err)
	}
	c := NewClient(hc)
	defer c.Close()
	if _, err := c.Ping(tctx(t)); err != nil {
		t.Fatal(err)
	}
	if out, _, _ := run(t, c, ExecRequest{Argv: []string{"echo", "ok"}}, nil); out != "ok\n" {
		t.Fatalf("out = %q", out)
	}
	if _, err := os.Stat(marker); err == nil {
		t.Error("a request from before the HELLO ran")
	}
}

// TestStuckPartialFrame: a cut-short header announcing a big payload makes
// the guest wait for bytes; the HELLO retry's padding unsticks it.
func TestStuckPartialFrame(t *testing.T) {
	hc, gc := socketpair(t)
	go testServer(t).ServeConn(context.Background(), gc)
	big := appendFrame(nil, frameStdin, 5, make([]byte, MaxPayload))
	if _, err := hc.Write(big[:100]); err != nil {
		t.Fatal(err)
	}
	c := NewClient(hc)
	defer c.Close()
	if _, err := c.Ping(tctx(t)); err != nil {
		t.Fatal(err)
	}
}

// waitPid waits for a pid file the guest process writes.
func waitPid(t *testing.T, path string) int {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		b, err := os.ReadFile(path)
		if err == nil && strings.HasSuffix(string(b), "\n") {
			pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if err != nil {
				t.Fatal(err)
			}
			return pid
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("process did not start")
	return 0
}

func waitGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil || strings.Contains(string(b), ") Z ") {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("process %d still alive", pid)
}

// TestDisconnectKills: a host that goes away mid-exec leaves no process
// behind, children included.
func TestDisconnectKills(t *testing.T) {
	hc, gc := socketpair(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		testServer(t).ServeConn(context.Background(), gc)
	}()
	c := NewClient(hc)
	pidfile := t.TempDir() + "/pid"
	ctx, cancel := context.WithCancel(tctx(t))
	go c.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", "sleep 100 & echo $! > " + pidfile + "; wait"}}, nil, nil, nil, nil)
	pid := waitPid(t, pidfile)
	cancel()
	c.Close()
	<-done
	waitGone(t, pid)
}

// TestHelloAborts: a new host on the same stream (the virtio-serial case)
// kills what the previous host started, and none of its output leaks.
func TestHelloAborts(t *testing.T) {
	hc, gc := socketpair(t)
	go testServer(t).ServeConn(context.Background(), gc)
	// The first host starts a chatty exec and vanishes without reading.
	pidfile := t.TempDir() + "/pid"
	var old []byte
	old = appendFrame(old, frameHello, 1, make([]byte, 16))
	old = appendFrame(old, frameRequest, 2, []byte(`{"method":"exec","params":{"argv":["sh","-c","echo $$ > `+pidfile+`; while :; do echo old; done"]}}`))
	if _, err := hc.Write(old); err != nil {
		t.Fatal(err)
	}
	pid := waitPid(t, pidfile)
	time.Sleep(50 * time.Millisecond) // let output pile up in the stream
	c2 := NewClient(hc)
	var out bytes.Buffer
	code, err := c2.Exec(tctx(t), ExecRequest{Argv: []string{"echo", "new"}}, nil, &out, nil, nil)
	if err != nil || code != 0 || out.String() != "new\n" {
		t.Fatalf("code=%d err=%v out=%q", code, err, out.String())
	}
	waitGone(t, pid)
}

// TestTimeout: an agent that never answers makes calls fail with the
// context's error, not hang.
func TestTimeout(t *testing.T) {
	hc, gc := socketpair(t)
	go io.Copy(io.Discard, gc) // reads everything, answers nothing
	c := NewClient(hc)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Ping(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
	if time.Since(start) > 2*time.Second {
		t.Fatal("timeout took too long")
	}
	// An agent that does not even read: the write blocks, the deadline
	// still applies.
	hc2, _ := socketpair(t)
	c2 := NewClient(hc2)
	defer c2.Close()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel2()
	if _, err := c2.Exec(ctx2, ExecRequest{Argv: []string{"cat"}}, bytes.NewReader(make([]byte, 10<<20)), nil, nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
}

// TestConcurrentPorts: several hosts, each on its own port, exec at once.
func TestConcurrentPorts(t *testing.T) {
	s := testServer(t)
	var wg sync.WaitGroup
	for i := range 4 {
		c := start(t, s)
		wg.Add(1)
		go func() {
			defer wg.Done()
			want := strings.Repeat("x", i+1)
			var out bytes.Buffer
			code, err := c.Exec(tctx(t), ExecRequest{Argv: []string{"sh", "-c", "sleep 0.2; echo " + want}}, nil, &out, nil, nil)
			if err != nil || code != 0 || out.String() != want+"\n" {
				t.Errorf("port %d: code=%d err=%v out=%q", i, code, err, out.String())
			}
		}()
	}
	wg.Wait()
}

// blockingWriter blocks every Write until release is closed.
type blockingWriter struct {
	release chan struct{}
	n       int
}

func (w *blockingWriter) Write(p []byte) (int, error) {
	<-w.release
	w.n += len(p)
	return len(p), nil
}

// TestBackpressure: a host that does not take output stalls the guest
// process instead of making the agent buffer it.
func TestBackpressure(t *testing.T) {
	c := start(t, testServer(t))
	dir := t.TempDir()
	w := &blockingWriter{release: make(chan struct{})}
	const size = 20 << 20
	done := make(chan error, 1)
	go func() {
		code, err := c.Exec(tctx(t), ExecRequest{Argv: []string{"sh", "-c", "head -c 20971520 /dev/zero; echo > " + dir + "/done"}}, nil, w, nil, nil)
		if err == nil && code != 0 {
			err = errors.New("exit code " + strconv.Itoa(code))
		}
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	if _, err := os.Stat(dir + "/done"); err == nil {
		t.Fatal("the process wrote 20 MiB while the host took nothing")
	}
	close(w.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if w.n != size {
		t.Fatalf("got %d bytes, want %d", w.n, size)
	}
}

// TestAgentRestarted: a host still connected to a port when the agent
// restarts gets ErrAgentRestarted for its call, and the next call works.
func TestAgentRestarted(t *testing.T) {
	hc, gc := socketpair(t)
	c := NewClient(hc)
	defer c.Close()
	go func() { // a guest that answers the HELLO, then "restarts"
		d := newDecoder(gc)
		for {
			f, err := d.next()
			if err != nil {
				return
			}
			var out []byte
			switch f.Type {
			case frameHello:
				b, _ := json.Marshal(helloMsg{Nonce: f.Payload, Version: Version})
				out = appendFrame(nil, frameHello, f.ID, b)
			case frameRequest:
				if f.ID == 2 {
					b, _ := json.Marshal(helloMsg{Version: Version, Started: true})
					out = appendFrame(nil, frameHello, 0, b)
				} else {
					out = appendFrame(nil, frameResponse, f.ID, []byte(`{"result":{"version":"x"}}`))
				}
			}
			gc.Write(out)
		}
	}()
	if _, err := c.Ping(tctx(t)); !errors.Is(err, ErrAgentRestarted) {
		t.Fatalf("err = %v, want ErrAgentRestarted", err)
	}
	if in, err := c.Ping(tctx(t)); err != nil || in.Version != "x" {
		t.Fatalf("after restart: %+v %v", in, err)
	}
}
