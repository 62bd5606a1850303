package agent

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
