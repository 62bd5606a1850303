//go:build e2e

package testenv

import (
	"path/filepath"
	"testing"

	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
)

// TestServeEgress: E2B's network options through the unmodified JS SDK
// against kvbox serve, on TestEgress's fake internet (serve-egress.test.mjs):
// allowOut by name with denyOut 0.0.0.0/0, updateNetwork on the running
// sandbox (its processes untouched), allowInternetAccess false with an
// address allowed, and a rule kvbox cannot enforce refused.
func TestServeEgress(t *testing.T) {
	caPEM := setupEgressNet(t)
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	v := envdtest.Versions[0]
	if p, ok := envdtest.Installed(repo, v); !ok {
		t.Fatalf("%s missing: run testenv/setup.sh (it installs the pinned E2B SDKs)", p)
	}
	src, tmpl := name(t, "segsrc"), name(t, "segwarm")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", tmpl) })
	t.Cleanup(func() { kvbox(t, "rm", "--force", src) })
	mustKvbox(t, "new", "--image", "debian", "--cpus", "1", "--memory", "1G", "--timeout", "300s", src)
	egBox{t, src}.prepare(caPEM)
	mustKvbox(t, "snapshots", "new", src, tmpl)
	mustKvbox(t, "rm", "--force", src)
	cleanupSandboxes(t, tmpl)
	p := startServe(t, "127.0.0.1:0")
	if err := runNode(t, v, p, tmpl, "", []string{"KVBOX_ALLOWED_IP=" + egAllowed, "KVBOX_OTHER_IP=" + egOther},
		"--test-reporter=spec", "--test-force-exit", filepath.Join(envdtest.Dir(repo), "serve-egress.test.mjs")); err != nil {
		t.Fatalf("the SDK's network options against kvbox serve: %v", err)
	}
}
