//go:build e2e

package testenv

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
	"kvbox.dev/kvbox/image"
)

// codeInterpSDK is the pinned install of E2B's code-interpreter SDK
// (testenv/e2b/code-interpreter-V, with the e2b it needs).
const codeInterpSDK = "code-interpreter-2.8.0"

// codeInterpTemplate is the SDK's default template.
const codeInterpTemplate = "code-interpreter-v1"

// TestCodeInterpreter: E2B's code-interpreter SDK, unmodified, against
// kvbox serve, on warm clones of code-interpreter-v1: a box of the
// code-interpreter image snapshotted once its server said its Python
// kernel is up with the data stack imported (code-interpreter.test.mjs:
// state, a PNG, errors, streaming, contexts, bash, env vars, a timeout, a
// client that goes mid-cell, a kernel that dies, five sandboxes at once).
func TestCodeInterpreter(t *testing.T) {
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if p, ok := installedPkg(repo, codeInterpSDK, "@e2b/code-interpreter"); !ok {
		t.Fatalf("%s missing: run testenv/setup.sh (it installs the pinned E2B SDKs)", p)
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
	// What the kernel has imported, from the server's own journal.
	t.Logf("server log:\n%s", inBox(t, src, "journalctl -u kvbox-codeinterp --no-pager | tail -n 20"))
	mustKvbox(t, "snapshots", "new", src, codeInterpTemplate)
	mustKvbox(t, "rm", "--force", src)
	cleanupSandboxes(t, codeInterpTemplate)

	p := startServe(t, "127.0.0.1:0")
	if err := runNode(t, codeInterpSDK, p, codeInterpTemplate, "", nil, "--test-reporter=spec", "--test-force-exit",
		filepath.Join(envdtest.Dir(repo), "code-interpreter.test.mjs")); err != nil {
		t.Fatalf("the code interpreter SDK's run against kvbox serve failed: %v", err)
	}
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
