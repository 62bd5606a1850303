package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"kvbox.dev/kvbox/guest-agent/envd"
)

// envdServer is an agent whose envd listens on a free loopback port and
// keeps its configuration in a temporary state folder.
func envdTestServer(t *testing.T, stateDir string) *Server {
	s := testServer(t)
	s.StateDir = stateDir
	s.EnvdAddr = "127.0.0.1:0"
	return s
}

// httpOver sends one raw HTTP/1.1 request on conn and reads the answer.
func httpOver(t *testing.T, conn net.Conn, raw string) (*http.Response, string) {
	t.Helper()
	if _, err := io.WriteString(conn, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func statRequest(path, token string) string {
	body := fmt.Sprintf(`{"path":%q}`, path)
	tok := ""
	if token != "" {
		tok = "X-Access-Token: " + token + "\r\n"
	}
	return fmt.Sprintf("POST /filesystem.Filesystem/Stat HTTP/1.1\r\nHost: envd\r\nContent-Type: application/json\r\nConnect-Protocol-Version: 1\r\n%sContent-Length: %d\r\nConnection: close\r\n\r\n%s", tok, len(body), body)
}

// The host reaches envd as a stream to the dial address "envd", with no
// guest port; the guest's loopback listener starts only once envd-init
// configured it; the configuration (token included) is kept, root's only,
// and restored by an agent that restarts.
func TestEnvdFeature(t *testing.T) {
	state := t.TempDir()
	s := envdTestServer(t, state)
	c := start(t, s)
	in, err := c.Ping(tctx(t))
	if err != nil || !in.Has(FeatureEnvd) {
		t.Fatalf("ping: %v, features %v: want %q", err, in.Features, FeatureEnvd)
	}
	if a := s.EnvdAddrListening(); a != "" {
		t.Fatalf("envd listens on %s before the host configured it", a)
	}
	// A Forwarder owns its client: each gets a connection of its own.
	f, err := start(t, s).Forward(tctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	stream := func() net.Conn {
		mine, theirs := localPair(t)
		if _, err := f.Connect(tctx(t), EnvdDialAddress, mine); err != nil {
			t.Fatal(err)
		}
		return theirs
	}
	// Unconfigured: served to the host, with no token.
	resp, body := httpOver(t, stream(), statRequest("/", ""))
	if resp.StatusCode != 200 || !strings.Contains(body, `"FILE_TYPE_DIRECTORY"`) {
		t.Fatalf("Stat over the agent stream: %d %s", resp.StatusCode, body)
	}

	cfg := envd.Config{SandboxID: "sbx1", EnvVars: map[string]string{"A": "1"}}
	if err := c.EnvdInit(tctx(t), envd.Config{EnvVars: map[string]string{"A=B": "x"}}); err == nil {
		t.Error("a bad configuration was accepted")
	}
	if err := c.EnvdInit(tctx(t), cfg); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{envdConfigFile, EnvdTokenFile} {
		st, err := os.Stat(filepath.Join(state, f))
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("kept %s: %v %v, want mode 0600", f, st, err)
		}
	}
	addr := s.EnvdAddrListening()
	if !strings.HasPrefix(addr, "127.0.0.1:") {
		t.Fatalf("after envd-init envd listens on %q, want the guest's loopback", addr)
	}
	// The host's streams need no token: the host checked its caller.
	if resp, body := httpOver(t, stream(), statRequest("/", "")); resp.StatusCode != 200 {
		t.Errorf("no token over the agent stream: %d %s", resp.StatusCode, body)
	}
	keepAlive(t, stream())
	local := localEnvdToken(t, state)
	onLoopback := func(tok string) int {
		lc, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer lc.Close()
		resp, _ := httpOver(t, lc, statRequest("/", tok))
		return resp.StatusCode
	}
	if code := onLoopback(""); code != 401 {
		t.Errorf("no token on the guest's listener: %d", code)
	}
	if code := onLoopback(local); code != 200 {
		t.Errorf("the local token on the guest's listener: %d", code)
	}

	restartServesSame(t, state, local)

	// Every token the agent takes (a snapshot's, the source's own after
	// the copy, a clone's at its identity) mints the local token again:
	// the one before opens nothing, and the file is the same file,
	// overwritten in place.
	before, _ := os.Stat(filepath.Join(state, EnvdTokenFile))
	for i, snapshot := range []bool{true, false} {
		tok := bytes.Repeat([]byte{byte('a' + i)}, TokenSize)
		if _, err := c.SetToken(tctx(t), tok, snapshot); err != nil {
			t.Fatal(err)
		}
		renewed := localEnvdToken(t, state)
		if renewed == local {
			t.Fatalf("set-token (snapshot %v) left the local token as it was", snapshot)
		}
		if code := onLoopback(local); code != 401 {
			t.Errorf("after set-token (snapshot %v) the local token before it: %d, want 401", snapshot, code)
		}
		if code := onLoopback(renewed); code != 200 {
			t.Errorf("after set-token (snapshot %v) the new local token: %d", snapshot, code)
		}
		local = renewed
	}
	after, _ := os.Stat(filepath.Join(state, EnvdTokenFile))
	if !os.SameFile(before, after) {
		t.Error("the local token's file was replaced, not overwritten in place")
	}
	if !slices.Contains(Features(), FeatureEnvd) {
		t.Error("not advertised")
	}
}

// keepAlive: two requests on one stream are both answered.
func keepAlive(t *testing.T, conn net.Conn) {
	t.Helper()
	for range 2 {
		raw := "GET /health HTTP/1.1\r\nHost: envd\r\n\r\n"
		io.WriteString(conn, raw)
	}
	br := bufio.NewReader(conn)
	for i := range 2 {
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != 204 {
			t.Fatalf("health #%d on one stream: %v %v", i, resp, err)
		}
	}
}

// restartServesSame: an agent that restarts on the state dir serves the
// same sandbox (TestEnvdFeature's configuration) with the same local
// token.
func restartServesSame(t *testing.T, state, local string) {
	t.Helper()
	s2 := envdTestServer(t, state)
	if err := s2.RestoreEnvd(); err != nil {
		t.Fatal(err)
	}
	if got := s2.envdServer().Config(); got.SandboxID != "sbx1" || got.EnvVars["A"] != "1" {
		t.Errorf("restored %+v", got)
	}
	if got := s2.envdServer().LocalToken(); got != local {
		t.Errorf("restored local token %q, want %q", got, local)
	}
	if s2.EnvdAddrListening() == "" {
		t.Error("a restored envd does not listen")
	}
}

// localEnvdToken is the local token the agent keeps in state.
func localEnvdToken(t *testing.T, state string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(state, EnvdTokenFile))
	if err != nil {
		t.Fatal(err)
	}
	tok := strings.TrimSpace(string(b))
	if !validEnvdToken(tok) {
		t.Fatalf("%s holds %q, not a token", EnvdTokenFile, b)
	}
	return tok
}

// A configuration kept by an older agent held the client's token: the
// next one is written over it in place, and nothing of it is left in the
// file (or, beyond the file's new end, in the blocks it had).
func TestEnvdConfigOverwrittenInPlace(t *testing.T) {
	state := t.TempDir()
	path := filepath.Join(state, envdConfigFile)
	old := `{"access_token":"` + strings.Repeat("c0ffee", 20) + `","env_vars":{"LONG":"` + strings.Repeat("x", 4000) + `"}}`
	if err := os.WriteFile(path, []byte(old), 0o644); err != nil {
		t.Fatal(err)
	}
	before, _ := os.Stat(path)
	s := envdTestServer(t, state)
	s.EnvdAddr = "-"
	if err := s.EnvdInit(envd.Config{SandboxID: "sbx2"}); err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(path)
	if err != nil || !os.SameFile(before, after) || after.Mode().Perm() != 0o600 {
		t.Fatalf("the configuration's file: %v %v (same file %v), want the same file, 0600", after, err, os.SameFile(before, after))
	}
	b, _ := os.ReadFile(path)
	if strings.Contains(string(b), "c0ffee") || !strings.Contains(string(b), "sbx2") {
		t.Errorf("kept %s", b)
	}
}

// The guest's port already taken: envd-init says so, and the host's
// streams are served with the configuration all the same.
func TestEnvdInitPortTaken(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	s := testServer(t)
	s.EnvdAddr = l.Addr().String()
	c := start(t, s)
	err = c.EnvdInit(tctx(t), envd.Config{SandboxID: "x"})
	var re *RemoteError
	if !errors.As(err, &re) || !strings.Contains(re.Message, "cannot listen on "+l.Addr().String()) {
		t.Fatalf("envd-init with the port taken: %v", err)
	}
	if s.envdServer().Config().SandboxID != "x" {
		t.Error("the configuration was not applied")
	}
}

// recordReads keeps every byte read from a connection.
type recordReads struct {
	net.Conn
	mu  sync.Mutex
	got []byte
}

func (r *recordReads) Read(b []byte) (int, error) {
	n, err := r.Conn.Read(b)
	r.mu.Lock()
	r.got = append(r.got, b[:n]...)
	r.mu.Unlock()
	return n, err
}

// requests counts the requests of each method in what r read.
func (r *recordReads) requests(t *testing.T) map[string]int {
	t.Helper()
	r.mu.Lock()
	d := newDecoder(bytes.NewReader(append([]byte(nil), r.got...)))
	r.mu.Unlock()
	n := map[string]int{}
	for {
		f, err := d.next()
		if err != nil {
			return n
		}
		var req request
		if f.Type == frameRequest && json.Unmarshal(f.Payload, &req) == nil {
			n[req.Method]++
		}
	}
}

// A clone's envd-init goes in its identify round trip, and reaches the
// agent once even when the guest is slower than the HELLO's retry (which
// writes the pipelined calls again: two envd-inits at once raced on the
// configuration file, and one failed the clone).
func TestEnvdInitInSlowFirstContact(t *testing.T) {
	s := envdTestServer(t, t.TempDir())
	hc, gc := socketpair(t)
	rec := &recordReads{Conn: gc}
	go s.serveConn(context.Background(), &slowStart{Conn: rec, delay: 1300 * time.Millisecond}, true)
	c := NewClient(hc)
	defer c.Close()
	cfg := envd.Config{SandboxID: "sbx1"}
	if err := c.Reidentify(tctx(t), Identity{Hostname: "c1"}, time.Now(), nil, nil, EnvdInitCall(cfg)); err != nil {
		t.Fatalf("a slow first contact with envd-init: %v", err)
	}
	if got := s.envdServer().Config(); got.SandboxID != "sbx1" {
		t.Errorf("envd's configuration after the first contact: %+v", got)
	}
	n := rec.requests(t)
	if n[methodIdentify] < 2 {
		t.Fatalf("the HELLO was not retried (identify sent %d times): the guest was not slow enough for this test", n[methodIdentify])
	}
	if n[methodEnvdInit] != 1 {
		t.Errorf("envd-init reached the agent %d times", n[methodEnvdInit])
	}
}
