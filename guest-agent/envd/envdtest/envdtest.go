// Package envdtest runs the real E2B JS SDK (testenv/e2b, installed by
// testenv/setup.sh) against an envd, for envd's conformance tests: on the
// host (guest-agent/envd) and in a guest through the agent channel
// (testenv). It stands in for E2B's control plane, which kvbox serve
// implements, with the one sandbox the test serves.
package envdtest

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Versions are the pinned installs of testenv/e2b: the newest, and the
// first that sends the routing headers on /files.
var Versions = []string{"2.51.0", "2.14.1"}

// Sandbox is what the control plane stub hands out, and what the
// conformance script checks.
type Sandbox struct {
	ID, Token, EnvdVersion string
	// BadTokenID is a sandbox id the stub answers with a wrong token.
	BadTokenID string
	// EnvdURL is E2B_SANDBOX_URL: where the SDK sends envd's calls.
	EnvdURL string
	// Scratch is the folder (as envd sees it) the script works in.
	Scratch string
	// Foo is the value of the sandbox's variable FOO.
	Foo string
	// HasUser says the envd's machine has the user "user" (/home/user).
	HasUser bool
}

// ControlPlane serves the SDK's create and connect (v1 and v2 paths) with
// sb, and its kill.
func ControlPlane(sb Sandbox) http.Handler {
	answer := func(w http.ResponseWriter, status int, id, token string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(map[string]any{
			"templateID": "base", "sandboxID": id, "clientID": "kvbox", "envdVersion": sb.EnvdVersion,
			"envdAccessToken": token, "domain": "kvbox.localhost",
		})
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := strings.TrimPrefix(r.URL.Path, "/v2")
		switch {
		case r.Method == http.MethodPost && p == "/sandboxes":
			answer(w, http.StatusCreated, sb.ID, sb.Token)
		case r.Method == http.MethodPost && p == "/sandboxes/"+sb.ID+"/connect":
			answer(w, http.StatusOK, sb.ID, sb.Token)
		case r.Method == http.MethodPost && p == "/sandboxes/"+sb.BadTokenID+"/connect":
			answer(w, http.StatusOK, sb.BadTokenID, strings.Repeat("0", len(sb.Token)))
		case r.Method == http.MethodDelete && strings.HasPrefix(p, "/sandboxes/"):
			w.WriteHeader(http.StatusNoContent)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, `{"code":404,"message":"%s %s: not in the conformance stub"}`, r.Method, r.URL.Path)
		}
	})
}

// Dir is testenv/e2b, from repo, the repository's root.
func Dir(repo string) string { return filepath.Join(repo, "testenv", "e2b") }

// Installed says whether set-up installed version v.
func Installed(repo, v string) (string, bool) {
	p := filepath.Join(Dir(repo), v, "node_modules", "e2b", "package.json")
	_, err := os.Stat(p)
	return p, err == nil
}

// Run serves the control plane stub on a free loopback port and runs the
// conformance script with SDK version v against sb; stdout and stderr get
// node's output. dir is node's working directory.
func Run(ctx context.Context, repo, v string, sb Sandbox, dir string, stdout, stderr *os.File) error {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer l.Close()
	api := &http.Server{Handler: ControlPlane(sb)}
	go api.Serve(l)
	defer api.Close()
	key := make([]byte, 20)
	for i := range key {
		key[i] = byte(i*37 + 11)
	}
	node := exec.CommandContext(ctx, "node", "--test-reporter=spec", filepath.Join(Dir(repo), "envd-conformance.test.mjs"))
	node.Dir = dir
	hasUser := ""
	if sb.HasUser {
		hasUser = "1"
	}
	node.Env = append(os.Environ(),
		"E2B_SDK_DIR="+filepath.Join(Dir(repo), v),
		"E2B_API_URL=http://"+l.Addr().String(),
		"E2B_SANDBOX_URL="+sb.EnvdURL,
		fmt.Sprintf("E2B_API_KEY=e2b_%x", key),
		"E2B_DOMAIN=kvbox.localhost",
		"KVBOX_SANDBOX_ID="+sb.ID, "KVBOX_BAD_TOKEN_ID="+sb.BadTokenID,
		"KVBOX_SCRATCH="+sb.Scratch, "KVBOX_ENV_FOO="+sb.Foo, "KVBOX_HAS_USER="+hasUser,
		"NO_PROXY=*", "HTTP_PROXY=", "HTTPS_PROXY=", "http_proxy=", "https_proxy=")
	node.Stdout, node.Stderr = stdout, stderr
	return node.Run()
}
