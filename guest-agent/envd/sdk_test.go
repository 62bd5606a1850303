package envd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// sdkVersions are the pinned installs of testenv/e2b: the newest, and the
// first that sends the routing headers on /files.
var sdkVersions = []string{"2.51.0", "2.14.1"}

// TestSDKConformance runs the real E2B JS SDK (testenv/e2b, installed by
// testenv/setup.sh) against this envd. Each version runs in a network
// namespace of its own (unshare --net, and --pid so that nothing it
// started outlives it): envd and a stub of E2B's control
// plane listen on its loopback, and node reaches nothing else. The
// processes the SDK starts are the child's, and work in a scratch folder.
func TestSDKConformance(t *testing.T) {
	gate.Root(t)
	gate.Tools(t, "node", "unshare", "ip")
	e2bDir, err := filepath.Abs("../../testenv/e2b")
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range sdkVersions {
		gate.File(t, filepath.Join(e2bDir, v, "node_modules", "e2b", "package.json"), "e2b@"+v+" installed by testenv/setup.sh")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range sdkVersions {
		t.Run("e2b@"+v, func(t *testing.T) {
			scratch := t.TempDir()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			// A pid namespace too: whatever the SDK started dies with the
			// child, its init, even when the child is killed.
			// A mount namespace: the child hides root's home under a tmpfs.
			cmd := exec.CommandContext(ctx, "unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--", self)
			cmd.WaitDelay = 10 * time.Second
			cmd.Env = append(os.Environ(), sdkChildEnv+"=1",
				"E2B_SDK_DIR="+filepath.Join(e2bDir, v),
				"KVBOX_SCRIPT="+filepath.Join(e2bDir, "envd-conformance.test.mjs"),
				"KVBOX_SCRATCH="+scratch)
			out, err := cmd.CombinedOutput()
			t.Logf("e2b@%s:\n%s", v, out)
			if err != nil {
				t.Fatalf("the SDK's conformance run failed: %v", err)
			}
		})
	}
}

// sdkChild runs inside the new network namespace: it serves envd and the
// control plane stub on loopback, runs node, and exits with node's status.
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
	key := make([]byte, 20)
	rand.Read(key)
	const sandboxID, badID = "sbxconformance01", "sbxwrongtoken01"
	cfg := Config{
		AccessToken:    hex.EncodeToString(tok),
		EnvVars:        map[string]string{"FOO": "from-the-sandbox"},
		DefaultWorkdir: scratch,
		SandboxID:      sandboxID,
		TemplateID:     "base",
	}
	s := New(Options{})
	if err := s.SetConfig(cfg); err != nil {
		return fail(err)
	}
	envdL, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", Port))
	if err != nil {
		return fail(err)
	}
	go (&http.Server{Handler: s}).Serve(envdL)
	apiL, err := net.Listen("tcp", "127.0.0.1:3000")
	if err != nil {
		return fail(err)
	}
	go (&http.Server{Handler: controlPlaneStub(sandboxID, badID, cfg.AccessToken)}).Serve(apiL)

	node := exec.Command("node", "--test-reporter=spec", os.Getenv("KVBOX_SCRIPT"))
	node.Dir = scratch
	node.Env = append(os.Environ(),
		"E2B_API_URL=http://127.0.0.1:3000",
		fmt.Sprintf("E2B_SANDBOX_URL=http://127.0.0.1:%d", Port),
		"E2B_API_KEY=e2b_"+hex.EncodeToString(key),
		"E2B_DOMAIN=kvbox.localhost",
		"KVBOX_SANDBOX_ID="+sandboxID, "KVBOX_BAD_TOKEN_ID="+badID,
		"KVBOX_ENV_FOO="+cfg.EnvVars["FOO"],
		"NO_PROXY=*", "HTTP_PROXY=", "HTTPS_PROXY=", "http_proxy=", "https_proxy=")
	node.Stdout, node.Stderr = os.Stdout, os.Stderr
	err = node.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return fail(err)
	}
	return 0
}

// controlPlaneStub answers the SDK's create and connect with the sandbox
// the child serves (badID with a wrong token), and its kill.
func controlPlaneStub(id, badID, token string) http.Handler {
	sandbox := func(w http.ResponseWriter, status int, id, token string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(map[string]any{
			"templateID": "base", "sandboxID": id, "clientID": "kvbox", "envdVersion": Version,
			"envdAccessToken": token, "domain": "kvbox.localhost",
		})
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := r.URL.Path
		switch {
		case r.Method == http.MethodPost && (p == "/sandboxes" || p == "/v2/sandboxes"):
			sandbox(w, http.StatusCreated, id, token)
		case r.Method == http.MethodPost && (p == "/sandboxes/"+id+"/connect" || p == "/v2/sandboxes/"+id+"/connect"):
			sandbox(w, http.StatusOK, id, token)
		case r.Method == http.MethodPost && (p == "/sandboxes/"+badID+"/connect" || p == "/v2/sandboxes/"+badID+"/connect"):
			sandbox(w, http.StatusOK, badID, strings.Repeat("0", len(token)))
		case r.Method == http.MethodDelete && strings.HasPrefix(p, "/sandboxes/"):
			w.WriteHeader(http.StatusNoContent)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, `{"code":404,"message":"%s %s: not in the conformance stub"}`, r.Method, p)
		}
	})
}
