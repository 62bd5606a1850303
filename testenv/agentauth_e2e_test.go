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
// which kvbox keeps in the box's folder (root's only). A snapshot's memory
// holds a token minted for it, kept for its clones' first contact; the box
// gets a new token right after, which ends the rights of every session
// authorised with the old one, and every clone gets a token of its own. The
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

	// A session authorised with the box's token, held across the
	// snapshot.
	held := dialAgent(t, src, token)
	if err := agentExec(held); err != nil {
		t.Fatalf("exec on a session with the box's token: %v", err)
	}

	// The snapshot's memory holds a token minted for it, which it keeps
	// (root's only) for its clones' first contact; the box's own token
	// never leaves the box's folder. The box gets a new one right after.
	snap := name(t, "authsnap")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src.Name, snap)
	sp := filepath.Join(stateDir, "snapshots", snap, domain.AgentTokenFile)
	stok, err := os.ReadFile(sp)
	if err != nil || len(stok) != agent.TokenSize {
		t.Fatalf("the snapshot's agent token: %x %v", stok, err)
	}
	if fi, err := os.Stat(sp); err != nil || fi.Mode().Perm() != 0o400 {
		t.Errorf("the snapshot's agent token mode: %v %v", fi, err)
	}
	if bytes.Equal(stok, token) {
		t.Errorf("the snapshot keeps the box's own agent token")
	}
	renewed, err := domain.ReadAgentToken(src.Dir)
	if err != nil || len(renewed) != agent.TokenSize || bytes.Equal(renewed, token) || bytes.Equal(renewed, stok) {
		t.Fatalf("the box's token after the snapshot: %x (before %x, the snapshot's %x): %v", renewed, token, stok, err)
	}
	for _, f := range []string{".new", ".snapshot"} {
		if _, err := os.Stat(filepath.Join(src.Dir, domain.AgentTokenFile+f)); !os.IsNotExist(err) {
			t.Errorf("%s%s is left in the box's folder: %v", domain.AgentTokenFile, f, err)
		}
	}
	// The box takes neither its old token nor the snapshot's, and the
	// session authorised with the old one is served nothing more.
	for what, tok := range map[string][]byte{"its old token": token, "the snapshot's token": stok} {
		if c, err := agent.DialSerialToken(context.Background(), sockets(src), tok); err == nil {
			c.Close()
			t.Errorf("the box took %s after the snapshot", what)
		}
	}
	if err := agentExec(held); err == nil || !strings.Contains(err.Error(), "not authorized") {
		t.Errorf("a session authorised with the box's old token still runs exec after the snapshot: %v", err)
	}
	if err := agentExec(dialAgent(t, src, renewed)); err != nil {
		t.Errorf("exec with the box's new token: %v", err)
	}
	mustKvbox(t, "exec", src.Name, "--", "true")

	// A clone's first contact presents the snapshot's token; its agent
	// then takes a token of its own and neither the snapshot's nor the
	// source's.
	cn := name(t, "authclone")
	if r := newClone(t, snap, cn); r.code != 0 {
		t.Fatalf("clone: %s", r)
	}
	c := getBox(t, cn)
	ctok, err := domain.ReadAgentToken(c.Dir)
	if err != nil || len(ctok) != agent.TokenSize || bytes.Equal(ctok, stok) || bytes.Equal(ctok, renewed) {
		t.Fatalf("the clone's token %x (the snapshot's %x, the source's %x): %v", ctok, stok, renewed, err)
	}
	if _, err := os.Stat(filepath.Join(c.Dir, domain.AgentTokenFile+".new")); !os.IsNotExist(err) {
		t.Errorf("the clone's new token is still beside its old one: %v", err)
	}
	// Powered off at once (no shutdown to flush the guest's page cache,
	// right after its agent took the token: before the guest's file
	// system commits on its own) and started again, the clone's agent
	// keeps its token and the clone its identity: the agent had both on
	// its disk before it answered.
	mustKvbox(t, "stop", "--force", cn)
	mustKvbox(t, "start", cn)
	if got, _ := domain.ReadAgentToken(c.Dir); !bytes.Equal(got, ctok) {
		t.Errorf("the clone's token changed across a restart")
	}
	if got := strings.TrimSpace(inBox(t, cn, "hostname")); got != cn {
		t.Errorf("the clone's hostname after a power-off and a cold boot is %q, want %q", got, cn)
	}
	if err := agentExec(dialAgent(t, c, ctok)); err != nil {
		t.Errorf("exec in the clone with its token: %v", err)
	}
	for what, tok := range map[string][]byte{"its source's token": renewed, "the snapshot's token": stok} {
		if cl, err := agent.DialSerialToken(context.Background(), sockets(c), tok); err == nil {
			cl.Close()
			t.Errorf("the clone took %s", what)
		}
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
