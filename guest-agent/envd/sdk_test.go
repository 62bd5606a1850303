package envd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
	"kvbox.dev/kvbox/testenv/gate"
)

// sdkChildEnv, set, makes the test binary the conformance child instead of
// running tests (TestMain).
const sdkChildEnv = "KVBOX_ENVD_SDK_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(sdkChildEnv) != "" {
		os.Exit(sdkChild())
	}
	os.Exit(m.Run())
}

// TestSDKConformance runs the real E2B JS SDK (testenv/e2b, installed by
// testenv/setup.sh) against this envd. Each version runs in namespaces of
// its own: a network namespace, where envd and a stub of E2B's control
// plane listen on loopback and node reaches nothing else; a pid namespace,
// so that nothing the SDK started outlives the run; a mount namespace,
// where root's home is an empty tmpfs. The SDK's processes work in a
// scratch folder.
func TestSDKConformance(t *testing.T) {
	gate.Root(t)
	gate.Tools(t, "node", "unshare", "ip")
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range envdtest.Versions {
		p, _ := envdtest.Installed(repo, v)
		gate.File(t, p, "e2b@"+v+" installed by testenv/setup.sh")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range envdtest.Versions {
		t.Run("e2b@"+v, func(t *testing.T) {
			scratch := t.TempDir()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, "unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--", self)
			cmd.WaitDelay = 10 * time.Second
			cmd.Env = append(os.Environ(), sdkChildEnv+"=1", "KVBOX_REPO="+repo, "KVBOX_SDK_VERSION="+v, "KVBOX_SCRATCH="+scratch)
			out, err := cmd.CombinedOutput()
			t.Logf("e2b@%s:\n%s", v, out)
			if err != nil {
				t.Fatalf("the SDK's conformance run failed: %v", err)
			}
		})
	}
}

// sdkChild runs inside the new namespaces: it serves envd and the control
// plane stub on loopback, runs node, and exits with node's status.
func sdkChild() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "conformance child:", err)
		return 2
	}
	if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
		return fail(fmt.Errorf("ip link set lo up: %v: %s", err, out))
	}
	// The SDK's commands run as root: their login shells read an empty
	// home, not the host's root's profile, and nothing they write by
	// mistake outside the scratch folder lands there.
	if err := unix.Mount("kvbox-envd-test", "/root", "tmpfs", 0, "mode=0700"); err != nil {
		return fail(fmt.Errorf("a tmpfs on /root (in the test's own mount namespace): %w", err))
	}
	scratch := os.Getenv("KVBOX_SCRATCH")
	tok := make([]byte, 16)
	rand.Read(tok)
	token := hex.EncodeToString(tok)
	cfg := Config{
		EnvVars:        map[string]string{"FOO": "from-the-sandbox"},
		DefaultWorkdir: scratch,
		SandboxID:      "sbxconformance01",
		TemplateID:     "base",
	}
	s := New(Options{})
	if err := s.SetConfig(cfg); err != nil {
		return fail(err)
	}
	// The loopback door, whose token checks are envd's own (on the host's
	// door serve checks the client's).
	s.SetLocalToken(token)
	envdL, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	go (&http.Server{Handler: s}).Serve(envdL)
	sb := envdtest.Sandbox{ID: cfg.SandboxID, Token: token, EnvdVersion: Version, BadTokenID: "sbxwrongtoken01",
		EnvdURL: "http://" + envdL.Addr().String(), Scratch: scratch, Foo: cfg.EnvVars["FOO"]}
	err = envdtest.Run(context.Background(), os.Getenv("KVBOX_REPO"), os.Getenv("KVBOX_SDK_VERSION"), sb, scratch, os.Stdout, os.Stderr)
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return fail(err)
	}
	return 0
}
