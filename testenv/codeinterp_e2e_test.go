//go:build e2e

package testenv

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
	"kvbox.dev/kvbox/image"
)

// codeInterpSDK is the pinned install of E2B's code-interpreter SDK
// (testenv/e2b/code-interpreter-V, with the e2b it needs).
const codeInterpSDK = "code-interpreter-2.8.0"

// codeInterpPySDK is the pinned install of E2B's code-interpreter Python
// SDK (testenv/e2b-py-code-interpreter/V, in the venv code-interpreter-V).
const codeInterpPySDK = "2.11.5"

// codeInterpTemplate is the SDK's default template.
const codeInterpTemplate = "code-interpreter-v1"

// TestCodeInterpreter: E2B's code-interpreter SDKs, unmodified, against
// kvbox serve, on warm clones of code-interpreter-v1: a box of the
// code-interpreter image snapshotted once its server said its Python
// kernel is up with the data stack imported. The JS SDK
// (code-interpreter.test.mjs: state, a PNG, errors, streaming, contexts,
// bash, env vars, a timeout, a client that goes mid-cell, a kernel that
// dies, five sandboxes at once), then the Python SDK, sync and async, on
// the same serve and template (testenv/e2b-py-code-interpreter: results
// with a PNG and a DataFrame's data, callbacks, errors, contexts, env vars,
// an endless loop cut by the SDK's timeout, a kernel that dies, 32 MiB of
// output through serve).
func TestCodeInterpreter(t *testing.T) {
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if p, ok := installedPkg(repo, codeInterpSDK, "@e2b/code-interpreter"); !ok {
		t.Fatalf("%s missing: run testenv/setup.sh (it installs the pinned E2B SDKs)", p)
	}
	pyVenvName := "code-interpreter-" + codeInterpPySDK
	py := filepath.Join(pyVenv(pyVenvName), "bin", "python")
	if out, err := exec.Command(py, "-I", "-c", "import e2b_code_interpreter, pytest").CombinedOutput(); err != nil {
		t.Fatalf("e2b-code-interpreter %s is not installed in %s (%v: %s): run testenv/setup.sh (it installs the pinned Python SDKs)", codeInterpPySDK, pyVenv(pyVenvName), err, out)
	}
	var ims []struct{ Name string }
	json.Unmarshal([]byte(mustKvbox(t, "images", "ls", "--json")), &ims)
	if !slices.ContainsFunc(ims, func(im struct{ Name string }) bool { return im.Name == image.CodeInterpreterImage }) {
		t.Fatalf("the code-interpreter image is not registered in %s: bin/kvbox --state-dir %s images build code-interpreter (in the root namespace) first", stateDir, stateDir)
	}

	// The template. Its name is the SDK's default, so one left by an
	// earlier run (and its clones) goes first.
	removeTemplate(t)
	src := name(t, "cisrc")
	t.Cleanup(func() { removeTemplate(t) })
	t.Cleanup(func() { kvbox(t, "rm", "--force", src) })
	start := time.Now()
	mustKvbox(t, "new", "--image", image.CodeInterpreterImage, "--cpus", "2", "--memory", "1G", "--timeout", "1200s", src)
	eventually(t, 10*time.Minute, func() error {
		r := kvbox(t, "exec", src, "--", "curl", "-sf", "http://127.0.0.1:49999/health")
		if r.code != 0 || r.stdout != `"OK"` {
			return fmt.Errorf("the code interpreter's health: %s", r)
		}
		return nil
	})
	t.Logf("the template's kernel was up with the data stack %s after kvbox new", time.Since(start).Round(time.Second))
	// The guest's other users cannot run cells through the server's
	// loopback listener (the user has sudo); the user, as whom cells run,
	// can list them. Nothing runs in the template's kernel here.
	for _, c := range []struct{ user, method, path, want string }{
		{"nobody", "POST", "/execute", "403"},
		{"nobody", "GET", "/contexts", "403"},
		{"user", "GET", "/contexts", "200"},
	} {
		got := inBox(t, src, fmt.Sprintf(`runuser -u %s -- curl -s -o /dev/null -w '%%{http_code}' -X %s -d '{"code": "open(\"/tmp/ran\", \"w\")"}' http://127.0.0.1:49999%s`,
			c.user, c.method, c.path))
		if got != c.want {
			t.Errorf("%s's %s %s on the guest's port 49999: %s, want %s", c.user, c.method, c.path, got, c.want)
		}
	}
	if r := kvbox(t, "exec", src, "--", "test", "-e", "/tmp/ran"); r.code == 0 {
		t.Errorf("a cell of nobody's ran")
	}
	// What the kernel has imported, from the server's own journal.
	t.Logf("server log:\n%s", inBox(t, src, "journalctl -u kvbox-codeinterp --no-pager | tail -n 20"))
	mustKvbox(t, "snapshots", "new", src, codeInterpTemplate)
	mustKvbox(t, "rm", "--force", src)
	cleanupSandboxes(t, codeInterpTemplate)

	p := startServe(t, "127.0.0.1:0")
	start = time.Now()
	if err := runNode(t, codeInterpSDK, p, codeInterpTemplate, "", nil, "--test-reporter=spec", "--test-force-exit",
		filepath.Join(envdtest.Dir(repo), "code-interpreter.test.mjs")); err != nil {
		t.Fatalf("the code interpreter SDK's run against kvbox serve failed: %v", err)
	}
	t.Logf("the JS SDK's run took %s", time.Since(start).Round(time.Second))
	start = time.Now()
	if err := runPytestIn(t, "e2b-py-code-interpreter", pyVenvName, p,
		"KVBOX_SERVE_PID="+strconv.Itoa(p.cmd.Process.Pid)); err != nil {
		t.Fatalf("the code interpreter Python SDK's run against kvbox serve failed: %v", err)
	}
	t.Logf("the Python SDK's run took %s", time.Since(start).Round(time.Second))
}

// removeTemplate removes the snapshot codeInterpTemplate and the boxes
// cloned from it.
func removeTemplate(t *testing.T) {
	for _, b := range listBoxes(t) {
		if b.Snapshot == codeInterpTemplate {
			kvbox(t, "rm", "--force", b.Name)
		}
	}
	kvbox(t, "snapshots", "rm", codeInterpTemplate)
}

// installedPkg says whether set-up installed npm package pkg in the
// testenv/e2b folder dir.
func installedPkg(repo, dir, pkg string) (string, bool) {
	p := filepath.Join(envdtest.Dir(repo), dir, "node_modules", filepath.FromSlash(pkg), "package.json")
	_, err := os.Stat(p)
	return p, err == nil
}
