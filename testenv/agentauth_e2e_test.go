//go:build e2e

package testenv

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
)

// dialAgent connects to a box's agent over its virtio-serial sockets, as
// kvbox does, presenting token (nil: none).
func dialAgent(t *testing.T, b box, token []byte) *agent.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := agent.DialSerialToken(ctx, sockets(b), token)
	if err != nil {
		t.Fatalf("dial the agent of %s: %v", b.Name, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func agentExec(c *agent.Client) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := c.Exec(ctx, agent.ExecRequest{Argv: []string{"true"}}, nil, nil, nil, nil)
	return err
}

// TestAgentAuth: a box's agent serves only a peer with the box's token,
// which kvbox keeps in the box's folder (root's only) and a snapshot keeps
// for its clones' first contact; every clone gets a token of its own. The
// check runs on the virtio-serial port here as it does on vsock (which this
// machine lacks): the same code.
func TestAgentAuth(t *testing.T) {
	src := newBox(t, name(t, "auth"))
	tokPath := filepath.Join(src.Dir, domain.AgentTokenFile)
	fi, err := os.Stat(tokPath)
	if err != nil {
		t.Fatalf("the box has no agent token: %v", err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("agent token mode %v", fi.Mode().Perm())
	}
	token, err := domain.ReadAgentToken(src.Dir)
	if err != nil || len(token) != agent.TokenSize {
		t.Fatalf("agent token: %x %v", token, err)
	}
	// Without the token: ping answers (who the agent is), nothing else.
	anon := dialAgent(t, src, nil)
	if _, err := anon.Ping(context.Background()); err != nil {
		t.Errorf("ping without a token: %v", err)
	}
	if err := agentExec(anon); err == nil || !strings.Contains(err.Error(), "not authorized") {
		t.Errorf("exec without the token: %v, want it refused", err)
	}
	anon.Close()
	if c, err := agent.DialSerialToken(context.Background(), sockets(src), bytes.Repeat([]byte{1}, agent.TokenSize)); err == nil {
		c.Close()
		t.Error("a wrong token was taken")
	}
	if err := agentExec(dialAgent(t, src, token)); err != nil {
		t.Errorf("exec with the box's token: %v", err)
	}
	mustKvbox(t, "exec", src.Name, "--", "true")

	// The snapshot keeps the token of the agent in its memory, root's only.
	snap := name(t, "authsnap")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src.Name, snap)
	sp := filepath.Join(stateDir, "snapshots", snap, domain.AgentTokenFile)
	if b, err := os.ReadFile(sp); err != nil || !bytes.Equal(b, token) {
		t.Errorf("the snapshot's agent token: %x %v", b, err)
	}
	if fi, err := os.Stat(sp); err != nil || fi.Mode().Perm() != 0o400 {
		t.Errorf("the snapshot's agent token mode: %v %v", fi, err)
	}
	// A clone's agent takes a token of its own: the source's is refused.
	cn := name(t, "authclone")
	if r := newClone(t, snap, cn); r.code != 0 {
		t.Fatalf("clone: %s", r)
	}
	c := getBox(t, cn)
	ctok, err := domain.ReadAgentToken(c.Dir)
	if err != nil || len(ctok) != agent.TokenSize || bytes.Equal(ctok, token) {
		t.Fatalf("the clone's token %x (source's %x): %v", ctok, token, err)
	}
	if _, err := os.Stat(filepath.Join(c.Dir, domain.AgentTokenFile+".new")); !os.IsNotExist(err) {
		t.Errorf("the clone's new token is still beside its old one: %v", err)
	}
	if err := agentExec(dialAgent(t, c, ctok)); err != nil {
		t.Errorf("exec in the clone with its token: %v", err)
	}
	if cl, err := agent.DialSerialToken(context.Background(), sockets(c), token); err == nil {
		cl.Close()
		t.Error("the clone took its source's token")
	}
	mustKvbox(t, "exec", cn, "--", "true")
	// Stopped and started again, the clone's agent keeps its token.
	mustKvbox(t, "stop", cn)
	mustKvbox(t, "start", cn)
	if got, _ := domain.ReadAgentToken(c.Dir); !bytes.Equal(got, ctok) {
		t.Errorf("the clone's token changed across a restart")
	}
	mustKvbox(t, "exec", cn, "--", "true")
}

func sockets(b box) []string {
	var paths []string
	for _, p := range domain.AgentSockets(b.Dir) {
		paths = append(paths, p.Path)
	}
	return paths
}
