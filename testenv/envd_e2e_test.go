//go:build e2e

package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/guest-agent/envd"
	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
)

// TestEnvdInGuest: the agent of a tiny box serves envd. The host configures
// it (envd-init) and reaches it through the agent channel (dial "envd"),
// which this test exposes on a loopback port of the test's namespace, as
// kvbox serve's router will; the real E2B SDK, both pinned versions, then
// runs its conformance script against the guest. Inside the guest envd
// listens on 127.0.0.1:49983 once configured, and wants the box's local
// token there, which every new agent token renews.
func TestEnvdInGuest(t *testing.T) {
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range envdtest.Versions {
		if p, ok := envdtest.Installed(repo, v); !ok {
			t.Fatalf("%s missing: run testenv/setup.sh (it installs the pinned E2B SDKs)", p)
		}
	}
	b := newBox(t, name(t, "envd"))
	token, err := os.ReadFile(filepath.Join(b.Dir, "agent.token"))
	if err != nil {
		t.Fatal(err)
	}
	c := dialAgent(t, b, token)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	in, err := c.Ping(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Require("envd", agent.FeatureEnvd); err != nil {
		t.Fatal(err)
	}
	// Before envd-init the guest has no envd listener.
	if r := kvbox(t, "exec", b.Name, "--", "wget", "-q", "-O", "-", "http://127.0.0.1:49983/health"); r.code == 0 {
		t.Errorf("envd answers in the guest before it was configured: %s", r)
	}
	scratch := "/srv/e2b-sdk"
	mustKvbox(t, "exec", b.Name, "--", "mkdir", "-p", scratch)
	cfg := envd.Config{EnvVars: map[string]string{"FOO": "from-the-host"},
		DefaultWorkdir: scratch, SandboxID: "sbx" + runID, TemplateID: "tiny"}
	if err := c.EnvdInit(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	// The guest's own processes reach envd on its loopback with the box's
	// local token, root's only in the agent's state folder.
	readLocal := func() string {
		r := mustKvbox(t, "exec", b.Name, "--", "cat", "/var/lib/kvbox-agent/"+agent.EnvdTokenFile)
		return strings.TrimSpace(r)
	}
	local := readLocal()
	envs := func(tok string) result {
		return kvbox(t, "exec", b.Name, "--", "wget", "-q", "-O", "-", "--header", "X-Access-Token: "+tok, "http://127.0.0.1:49983/envs")
	}
	if r := envs(local); r.code != 0 || strings.TrimSpace(r.stdout) != `{"FOO":"from-the-host"}` {
		t.Errorf("GET /envs in the guest: %s", r)
	}
	if r := kvbox(t, "exec", b.Name, "--", "wget", "-q", "-O", "-", "http://127.0.0.1:49983/envs"); r.code == 0 {
		t.Errorf("GET /envs in the guest without the token: %s", r)
	}
	// A new agent token (a snapshot's, a clone's) mints a new local one.
	newTok := make([]byte, agent.TokenSize)
	rand.Read(newTok)
	if _, err := c.SetToken(ctx, newTok, false); err != nil {
		t.Fatal(err)
	}
	// kvbox's own record of the agent's token follows (kvbox exec).
	if err := os.WriteFile(filepath.Join(b.Dir, "agent.token"), newTok, 0o600); err != nil {
		t.Fatal(err)
	}
	token = newTok
	if renewed := readLocal(); renewed == local || envs(local).code == 0 || envs(renewed).code != 0 {
		t.Errorf("after set-token the local token %q (was %q): the old one must open nothing, the new one /envs", renewed, local)
	}

	f, err := dialAgent(t, b, token).Forward(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			if _, err := f.Connect(ctx, agent.EnvdDialAddress, conn); err != nil {
				t.Logf("a stream to envd: %v", err)
				conn.Close()
			}
		}
	}()
	// The host's streams carry no token (kvbox serve checks the client's
	// on the host, TestServe): no sandbox of the stub has a wrong one.
	sb := envdtest.Sandbox{ID: cfg.SandboxID, Token: hex.EncodeToString(newTok), EnvdVersion: envd.Version,
		EnvdURL: "http://" + l.Addr().String(), Scratch: scratch, Foo: cfg.EnvVars["FOO"], HasUser: true}
	for _, v := range envdtest.Versions {
		t.Run("e2b@"+v, func(t *testing.T) {
			// A folder of its own, and envd configured again for it.
			sb := sb
			sb.Scratch = scratch + "/" + v
			mustKvbox(t, "exec", b.Name, "--", "mkdir", "-p", sb.Scratch)
			cfg := cfg
			cfg.DefaultWorkdir = sb.Scratch
			if err := c.EnvdInit(ctx, cfg); err != nil {
				t.Fatal(err)
			}
			out, err := os.CreateTemp(t.TempDir(), "node")
			if err != nil {
				t.Fatal(err)
			}
			err = envdtest.Run(ctx, repo, v, sb, t.TempDir(), out, out)
			b, _ := os.ReadFile(out.Name())
			t.Logf("e2b@%s against the guest's envd:\n%s", v, b)
			if err != nil {
				t.Fatalf("the SDK's conformance run failed: %v", err)
			}
		})
	}
}
