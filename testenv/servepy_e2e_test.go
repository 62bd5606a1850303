//go:build e2e

package testenv

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// pyVersions are the E2B Python SDKs testenv/e2b-py pins, one folder each
// with its requirements.txt (setup.sh's stage_e2b_py installs each into a
// venv of its own).
func pyVersions(t *testing.T) []string {
	t.Helper()
	reqs, err := filepath.Glob("e2b-py/*/requirements.txt")
	if err != nil || len(reqs) == 0 {
		t.Fatalf("no pinned Python SDK in testenv/e2b-py: %v", err)
	}
	var vs []string
	for _, r := range reqs {
		vs = append(vs, filepath.Base(filepath.Dir(r)))
	}
	return vs
}

// pyVenv is where setup.sh installs Python SDK version v.
func pyVenv(v string) string {
	return filepath.Join(envOr("KVBOX_TESTENV_CACHE", "/var/cache/kvbox-testenv"), "e2b-py", v)
}

// runPytest runs testenv/e2b-py's tests with the venv of SDK version v
// against serve, in a home of the test's own.
func runPytest(t *testing.T, v string, p *serveProc, template, page string) error {
	t.Helper()
	return runPytestIn(t, "e2b-py", v, p, "KVBOX_TEMPLATE="+template, "KVBOX_TEMPLATE_PAGE="+page)
}

// runPytestIn runs the pytest suite in testenv's folder dir with the venv
// named venv (pyVenv) against serve, in a home of the test's own, with
// env added to the E2B_* variables that name serve.
func runPytestIn(t *testing.T, dir, venv string, p *serveProc, env ...string) error {
	t.Helper()
	key := strings.TrimSpace(mustKvbox(t, "serve", "key"))
	url := "http://" + p.addr
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(pyVenv(venv), "bin", "python"), "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rA", ".")
	cmd.Dir = dir
	var clean []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "E2B_") || strings.HasPrefix(k, "PYTHON") || strings.HasPrefix(strings.ToUpper(k), "HTTP") || k == "HOME" {
			continue
		}
		clean = append(clean, kv)
	}
	cmd.Env = append(clean,
		"HOME="+t.TempDir(), "PYTHONDONTWRITEBYTECODE=1", "PYTHONNOUSERSITE=1", "NO_PROXY=*",
		"E2B_API_URL="+url, "E2B_SANDBOX_URL="+url, "E2B_API_KEY="+key, "KVBOX_SERVE_ADDR="+p.addr)
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	t.Logf("pytest (%s, %s):\n%s", dir, venv, out)
	return err
}

// TestServePython: the real, unmodified E2B Python SDK (each pinned
// version, its sync Sandbox and its async AsyncSandbox) against kvbox
// serve, on warm clones of a Debian template whose server on port 8000 was
// started before its snapshot: testenv/e2b-py's pytest run.
func TestServePython(t *testing.T) {
	vs := pyVersions(t)
	for _, v := range vs {
		py := filepath.Join(pyVenv(v), "bin", "python")
		if out, err := exec.Command(py, "-I", "-c", "import e2b, pytest").CombinedOutput(); err != nil {
			t.Fatalf("e2b %s is not installed in %s (%v: %s): run testenv/setup.sh (it installs the pinned Python SDKs)", v, pyVenv(v), err, out)
		}
	}
	var ims []struct{ Name string }
	json.Unmarshal([]byte(mustKvbox(t, "images", "ls", "--json")), &ims)
	if !slices.ContainsFunc(ims, func(im struct{ Name string }) bool { return im.Name == "debian" }) {
		t.Fatalf("the Debian image is not registered in %s: bin/kvbox --state-dir %s images build debian (in the root namespace) first", stateDir, stateDir)
	}
	page := "<h1>served to Python by the template " + runID + "</h1>"
	template := serveTemplate(t, page)
	cleanupSandboxes(t, template)
	p := startServe(t, "127.0.0.1:0")
	for _, v := range vs {
		t.Run("e2b@"+v, func(t *testing.T) {
			if err := runPytest(t, v, p, template, page); err != nil {
				t.Fatalf("the Python SDK's run against kvbox serve failed: %v", err)
			}
			noLeftovers(t)
		})
	}
}
