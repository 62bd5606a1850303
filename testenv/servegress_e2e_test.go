//go:build e2e

package testenv

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
)

// TestServeEgress: E2B's network options through the unmodified JS SDK
// against kvbox serve, on TestEgress's fake internet (serve-egress.test.mjs):
// allowOut by name with denyOut 0.0.0.0/0, updateNetwork on the running
// sandbox (its processes untouched), allowInternetAccess false with an
// address allowed, a rule kvbox cannot enforce refused; rules with a
// header from a Secret (the fake server gets it, the sandbox cannot read
// it: not in its environment, files, memory or definition), replaced by
// updateNetwork; and all of it beside another state dir's egress proxy.
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
	// Another state dir's egress proxy runs all along: each has ports
	// of its own, so this state dir's serves the sandboxes beside it.
	other := otherEgressProxy(t)
	p := startServe(t, "127.0.0.1:0")
	outFile := filepath.Join(t.TempDir(), "out.json")
	if err := runNode(t, v, p, tmpl, "", []string{"KVBOX_ALLOWED_IP=" + egAllowed, "KVBOX_OTHER_IP=" + egOther,
		"KVBOX_SECRET=" + egSecret, "KVBOX_OUT=" + outFile},
		"--test-reporter=spec", "--test-force-exit", filepath.Join(envdtest.Dir(repo), "serve-egress.test.mjs")); err != nil {
		t.Fatalf("the SDK's network options against kvbox serve: %v", err)
	}
	var left struct{ Sandbox, Snapshot string }
	if data, err := os.ReadFile(outFile); err != nil || json.Unmarshal(data, &left) != nil || left.Sandbox == "" || left.Snapshot == "" {
		t.Fatalf("the rules test left no sandbox and snapshot (%v)", err)
	}
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", left.Snapshot) })
	t.Cleanup(func() { kvbox(t, "rm", "--force", left.Sandbox) })
	// The secret is in none of what the sandbox had: its memory and disk
	// (the snapshot taken while a rule held it), its definition, what
	// egress show prints, serve's log or the proxy's.
	files, _ := filepath.Glob(filepath.Join(stateDir, "snapshots", left.Snapshot, "*"))
	if len(files) == 0 {
		t.Fatalf("snapshot %s has no files", left.Snapshot)
	}
	for _, f := range files {
		if out, _ := exec.Command("grep", "-c", "-a", "-F", egSecret, f).Output(); strings.TrimSpace(string(out)) != "0" {
			t.Errorf("the secret in snapshot file %s (%s)", f, strings.TrimSpace(string(out)))
		}
	}
	if x, _ := virsh("dumpxml", left.Sandbox); strings.Contains(x, egSecret) {
		t.Error("the secret in the sandbox's definition")
	}
	if out := mustKvbox(t, "egress", "show", "--json", left.Sandbox); strings.Contains(out, egSecret) {
		t.Error("egress show prints the secret")
	}
	if strings.Contains(p.out.String(), egSecret) {
		t.Error("the secret in serve's log")
	}
	if data, _ := os.ReadFile(filepath.Join(stateDir, "logs", "egress-proxy.log")); strings.Contains(string(data), egSecret) {
		t.Error("the secret in the proxy's log")
	}
	// The other state dir's proxy ran all along, on ports of its own.
	mine, err := os.ReadFile(filepath.Join(stateDir, "egress", "ports.json"))
	if err != nil {
		t.Fatal(err)
	}
	if string(mine) == string(other.ports) {
		t.Errorf("two state dirs' proxies on the same ports %s", mine)
	}
	select {
	case <-other.done:
		t.Errorf("the other state dir's proxy ended:\n%s", other.log.String())
	default:
	}
	t.Logf("egress proxy ports: this state dir %s, the other %s", strings.TrimSpace(string(mine)), strings.TrimSpace(string(other.ports)))
}

type egressProc struct {
	done  chan struct{}
	ports []byte
	log   *bytes.Buffer
}

// otherEgressProxy runs an egress proxy worker of a state dir of its own
// until the test ends.
func otherEgressProxy(t *testing.T) egressProc {
	t.Helper()
	dir := t.TempDir()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var log bytes.Buffer
	cmd := exec.Command(kvboxBin, "--state-dir", dir, "__egress-proxy", "--worker", "--ready-fd", "3")
	cmd.ExtraFiles = []*os.File{w}
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	line, _ := bufio.NewReader(r).ReadString('\n')
	if strings.TrimSpace(line) != "ok" {
		t.Fatalf("another state dir's egress proxy: %q\n%s", line, log.String())
	}
	ports, err := os.ReadFile(filepath.Join(dir, "egress", "ports.json"))
	if err != nil {
		t.Fatal(err)
	}
	return egressProc{done: done, ports: ports, log: &log}
}
