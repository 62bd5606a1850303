package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mdlayher/vsock"
)

// serveUntrusted serves one connection as the vsock listener does: any
// local user could have opened it.
func serveUntrusted(t *testing.T, s *Server, token []byte) *Client {
	t.Helper()
	c := serve(t, s, false)
	c.Token = token
	return c
}

func execTrue(c *Client) error {
	_, err := c.Exec(context.Background(), ExecRequest{Argv: []string{"true"}}, nil, nil, nil, nil)
	return err
}

// An agent without a token serves a trusted session (a virtio-serial port)
// and nothing of an untrusted one (vsock); once kvbox gives it a token
// (kept on disk, root's only), every session on every transport presents it
// before anything but ping.
func TestAuth(t *testing.T) {
	s := testServer(t)
	s.StateDir = t.TempDir()
	id := Identity{Hostname: "b4"}

	if err := execTrue(serveUntrusted(t, s, nil)); !errors.Is(err, ErrUnauthorized) && (err == nil || !strings.Contains(err.Error(), "not authorized")) {
		t.Fatalf("an untrusted session of an agent without a token ran exec: %v", err)
	}
	first := start(t, s)
	if err := execTrue(first); err != nil {
		t.Fatalf("a trusted session of an agent without a token: %v", err)
	}
	token := bytes.Repeat([]byte{7}, TokenSize)
	if err := first.Reidentify(tctx(t), id, time.Now(), nil, token); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(s.StateDir, tokenFile)); err != nil || !bytes.Equal(b, token) {
		t.Fatalf("token on disk: %x %v", b, err)
	}
	if fi, _ := os.Stat(filepath.Join(s.StateDir, tokenFile)); fi.Mode().Perm() != 0o600 {
		t.Errorf("token file mode %v", fi.Mode().Perm())
	}

	// A new agent process reads its token; every transport asks for it.
	s2 := testServer(t)
	s2.StateDir = s.StateDir
	for name, c := range map[string]*Client{"trusted": start(t, s2), "untrusted": serveUntrusted(t, s2, nil)} {
		if _, err := c.Ping(tctx(t)); err != nil {
			t.Errorf("%s, no token: ping: %v", name, err)
		}
		if err := execTrue(c); err == nil || !strings.Contains(err.Error(), "not authorized") {
			t.Errorf("%s session without the token ran exec: %v", name, err)
		}
	}
	wrong := serveUntrusted(t, s2, bytes.Repeat([]byte{8}, TokenSize))
	if _, err := wrong.Ping(tctx(t)); !errors.Is(err, ErrUnauthorized) {
		t.Errorf("a wrong token: %v, want ErrUnauthorized", err)
	}
	right := serveUntrusted(t, s2, token)
	if err := execTrue(right); err != nil {
		t.Fatalf("untrusted session with the token: %v", err)
	}
	if !right.Provisioned {
		t.Error("auth did not say the agent has a token")
	}
	// Auth also says the kernel's boot_id, as ping does: kvbox waits for
	// a clone's agent with it alone.
	if info, err := right.Ping(tctx(t)); err != nil || right.BootID == "" || right.BootID != info.BootID {
		t.Errorf("boot_id from auth %q, from ping %q (%v)", right.BootID, info.BootID, err)
	}
	// With it, a new token (a clone's); the old one is refused from then.
	next := bytes.Repeat([]byte{9}, TokenSize)
	if err := right.Reidentify(tctx(t), id, time.Now(), nil, next); err != nil {
		t.Fatal(err)
	}
	if err := execTrue(serveUntrusted(t, s2, token)); err == nil {
		t.Error("the old token still works after set-token")
	}
	if err := execTrue(serveUntrusted(t, s2, next)); err != nil {
		t.Errorf("the new token: %v", err)
	}
}

// vsockListener hands Serve connections that say they come from a vsock
// context, as the agent's listener does in a guest.
type vsockListener struct {
	conns chan net.Conn
	done  chan struct{}
}

func (l *vsockListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}
func (l *vsockListener) Close() error   { return nil }
func (l *vsockListener) Addr() net.Addr { return &vsock.Addr{ContextID: 3, Port: VsockPort} }

type vsockConn struct {
	net.Conn
	peer uint32
}

func (c vsockConn) RemoteAddr() net.Addr { return &vsock.Addr{ContextID: c.peer, Port: 40000} }

// Over vsock the agent serves the host (context 2) alone: not the guest
// itself (a guest user dialing its own agent through vsock loopback, with
// a token it learnt), not another context. Its port is privileged in the
// guest, so no guest user can listen there while the agent restarts.
func TestServeVsockOnlyFromHost(t *testing.T) {
	if VsockPort >= 1024 {
		t.Fatalf("VsockPort %d: any guest user may bind it", VsockPort)
	}
	s := testServer(t)
	l := &vsockListener{conns: make(chan net.Conn), done: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error)
	go func() { served <- s.Serve(ctx, l) }()
	t.Cleanup(func() { cancel(); close(l.done); <-served })

	for _, tc := range []struct {
		peer uint32
		want bool
	}{{vsock.Local, false}, {3, false}, {vsock.Hypervisor, false}, {vsock.Host, true}} {
		hc, gc := socketpair(t)
		l.conns <- vsockConn{gc, tc.peer}
		c := NewClient(hc)
		pctx, pcancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := c.Ping(pctx)
		pcancel()
		c.Close()
		if tc.want && err != nil {
			t.Errorf("the host (context %d): ping: %v", tc.peer, err)
		}
		if !tc.want && err == nil {
			t.Errorf("context %d was served", tc.peer)
		}
	}
}

// A first contact in one write (a clone's: HELLO, the token and the
// re-identification behind it, no wait between) is served in full by an
// agent that takes the token, and not at all by one that refuses it; behind
// a stuck, cut-short frame the HELLO's retry writes it all again.
func TestPipelinedFirstContact(t *testing.T) {
	s := testServer(t)
	s.StateDir = t.TempDir()
	token := bytes.Repeat([]byte{7}, TokenSize)
	if _, err := s.setToken(token, false); err != nil {
		t.Fatal(err)
	}
	fs := s.System.(*fakeSystem)
	id := Identity{Hostname: "c1"}

	wrong := serveUntrusted(t, s, bytes.Repeat([]byte{9}, TokenSize))
	if err := wrong.Reidentify(tctx(t), id, time.Now(), []byte("seed"), nil); !errors.Is(err, ErrUnauthorized) {
		t.Fatalf("first contact with a wrong token: %v", err)
	}
	if len(fs.identity) != 0 {
		t.Fatalf("an agent that refused the token applied %v", fs.identity)
	}

	c := serveUntrusted(t, s, token)
	next := bytes.Repeat([]byte{8}, TokenSize)
	if err := c.Reidentify(tctx(t), id, time.Now(), []byte("seed"), next); err != nil {
		t.Fatal(err)
	}
	if c.BootID == "" || c.BootID != bootID() {
		t.Errorf("boot_id from the pipelined auth: %q, want %q", c.BootID, bootID())
	}
	if len(fs.identity) != 1 || fs.identity[0].Hostname != "c1" {
		t.Errorf("identities applied: %v", fs.identity)
	}
	if !bytes.Equal(s.currentToken(), next) {
		t.Errorf("the agent's token was not replaced")
	}
	// The stream is in sync: the next call needs no HELLO.
	c.Token = next
	if _, err := c.Ping(tctx(t)); err != nil {
		t.Fatal(err)
	}

	hc, gc := socketpair(t)
	go s.serveConn(context.Background(), gc, false)
	big := appendFrame(nil, frameStdin, 5, make([]byte, MaxPayload))
	if _, err := hc.Write(big[:100]); err != nil {
		t.Fatal(err)
	}
	stuck := NewClient(hc)
	defer stuck.Close()
	stuck.Token = next
	if err := stuck.Reidentify(tctx(t), Identity{Hostname: "c2"}, time.Now(), nil, nil); err != nil {
		t.Fatal(err)
	}
	if last := fs.identity[len(fs.identity)-1]; last.Hostname != "c2" {
		t.Errorf("behind a stuck frame: identities applied %v", fs.identity)
	}

	// A guest slower than the HELLO's retry (a Debian clone under TCG) may
	// read the first write whole and then the retried one: the token it
	// is given must not make it refuse the retry's.
	hc, gc = socketpair(t)
	go s.serveConn(context.Background(), &slowStart{Conn: gc, delay: 1300 * time.Millisecond}, false)
	slow := NewClient(hc)
	defer slow.Close()
	slow.Token = next
	last := bytes.Repeat([]byte{6}, TokenSize)
	if err := slow.Reidentify(tctx(t), Identity{Hostname: "c3"}, time.Now(), nil, last); err != nil {
		t.Fatalf("a slow first contact: %v", err)
	}
	if !bytes.Equal(s.currentToken(), last) {
		t.Errorf("a slow first contact: the agent's token was not replaced")
	}
}

// slowStart is a connection whose first read waits.
type slowStart struct {
	net.Conn
	delay time.Duration
	once  bool
}

func (c *slowStart) Read(b []byte) (int, error) {
	if !c.once {
		c.once = true
		time.Sleep(c.delay)
	}
	return c.Conn.Read(b)
}

// Setting a token ends every other session's rights at once: a session
// authorised with the old token (a copy of it in a snapshot's memory, say)
// is served nothing more, on any transport, until it presents the new one.
// The session that set it goes on; an exec already running goes on.
func TestSetTokenEndsOtherSessions(t *testing.T) {
	s := testServer(t)
	s.StateDir = t.TempDir()
	old := bytes.Repeat([]byte{1}, TokenSize)
	if _, err := s.setToken(old, false); err != nil {
		t.Fatal(err)
	}
	setter := serveUntrusted(t, s, old)
	other := serveUntrusted(t, s, old)
	trusted := start(t, s)
	trusted.Token = old
	for name, c := range map[string]*Client{"setter": setter, "other": other, "trusted": trusted} {
		if err := execTrue(c); err != nil {
			t.Fatalf("%s with the token: %v", name, err)
		}
	}
	next := bytes.Repeat([]byte{2}, TokenSize)
	if _, err := setter.SetToken(tctx(t), next, false); err != nil {
		t.Fatal(err)
	}
	if err := execTrue(setter); err != nil {
		t.Errorf("the session that set the token: %v", err)
	}
	for name, c := range map[string]*Client{"untrusted": other, "trusted": trusted} {
		if err := execTrue(c); err == nil || !strings.Contains(err.Error(), "not authorized") {
			t.Errorf("%s session authorised with the old token still runs exec after set-token: %v", name, err)
		}
	}
	if err := execTrue(serveUntrusted(t, s, next)); err != nil {
		t.Errorf("a new session with the new token: %v", err)
	}

	// An agent without a token serves a trusted session; once another
	// one sets a token, that session is served no more either.
	s2 := testServer(t)
	s2.StateDir = t.TempDir()
	first, second := start(t, s2), start(t, s2)
	if err := execTrue(first); err != nil {
		t.Fatal(err)
	}
	if _, err := second.SetToken(tctx(t), next, false); err != nil {
		t.Fatal(err)
	}
	if err := execTrue(first); err == nil || !strings.Contains(err.Error(), "not authorized") {
		t.Errorf("a trusted session of the token-less agent still runs exec after another set a token: %v", err)
	}
}

// A snapshot's token, which travels with the snapshot, is served to
// trusted sessions (virtio-serial, root's on the host) only, also after
// the agent starts again; a token set after it serves both again.
func TestSnapshotTokenTrustedOnly(t *testing.T) {
	s := testServer(t)
	s.StateDir = t.TempDir()
	snap := bytes.Repeat([]byte{3}, TokenSize)
	c := start(t, s)
	if _, err := c.SetToken(tctx(t), snap, true); err != nil {
		t.Fatal(err)
	}
	s2 := testServer(t) // the agent started again (a clone booted cold)
	s2.StateDir = s.StateDir
	for _, srv := range []*Server{s, s2} {
		if err := execTrue(serveUntrusted(t, srv, snap)); err == nil || !strings.Contains(err.Error(), "not authorized") {
			t.Errorf("a snapshot's token over an untrusted transport: %v, want it refused", err)
		}
		tc := start(t, srv)
		tc.Token = snap
		if err := execTrue(tc); err != nil {
			t.Errorf("a snapshot's token over a trusted transport: %v", err)
		}
	}
	own := bytes.Repeat([]byte{4}, TokenSize)
	tc := start(t, s2)
	tc.Token = snap
	if _, err := tc.SetToken(tctx(t), own, false); err != nil {
		t.Fatal(err)
	}
	if err := execTrue(serveUntrusted(t, s2, own)); err != nil {
		t.Errorf("the clone's own token over an untrusted transport: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(s.StateDir, tokenFile)); err != nil || !bytes.Equal(b, own) {
		t.Errorf("token on disk %x %v, want %x", b, err, own)
	}
}

// A forwarder whose session lost its rights (the box was snapshotted: its
// token changed twice) presents the box's token again and dials on.
func TestForwarderPresentsNewToken(t *testing.T) {
	addr := listen(t, echo)
	s := testServer(t)
	s.StateDir = t.TempDir()
	old := bytes.Repeat([]byte{5}, TokenSize)
	if _, err := s.setToken(old, false); err != nil {
		t.Fatal(err)
	}
	fc := serveUntrusted(t, s, old)
	f, err := fc.Forward(tctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	next := bytes.Repeat([]byte{6}, TokenSize)
	f.Tokens = func() [][]byte { return [][]byte{bytes.Repeat([]byte{9}, TokenSize), next} }
	if _, err := serveUntrusted(t, s, old).SetToken(tctx(t), next, false); err != nil {
		t.Fatal(err)
	}
	mine, theirs := localPair(t)
	ended, err := f.Connect(tctx(t), addr, mine)
	if err != nil {
		t.Fatalf("dial after the token changed: %v", err)
	}
	theirs.Write([]byte("ping"))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(theirs, buf); err != nil || string(buf) != "ping" {
		t.Errorf("echo %q %v", buf, err)
	}
	theirs.Close()
	<-ended
	// Without the box's tokens it fails, saying why.
	f.Tokens = nil
	if _, err := serveUntrusted(t, s, next).SetToken(tctx(t), old, false); err != nil {
		t.Fatal(err)
	}
	mine, _ = localPair(t)
	if _, err := f.Connect(tctx(t), addr, mine); err == nil || !strings.Contains(err.Error(), "not authorized") {
		t.Errorf("dial with a stale token and none to present: %v", err)
	}
}
