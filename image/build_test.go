package image

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestProgressNotATerminal(t *testing.T) {
	var b bytes.Buffer
	p := &Progress{W: &b}
	st := p.Start("first")
	st.Status("ignored off a terminal")
	st.End(nil)
	p.Start("second").End(os.ErrNotExist)
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "✓ first (") || !strings.HasPrefix(lines[1], "✗ second (") {
		t.Errorf("output %q", b.String())
	}
	if strings.Contains(b.String(), "\r") || strings.Contains(b.String(), "ignored") {
		t.Errorf("terminal output off a terminal: %q", b.String())
	}
	var nilP *Progress
	nilP.Start("nowhere").End(nil) // a nil Progress prints nothing and does not panic
	nilP.Printf("x")
}

func TestProgressTerminal(t *testing.T) {
	var b bytes.Buffer
	p := &Progress{W: &b, TTY: true}
	st := p.Start("stage")
	st.Status("I: Retrieving apt")
	st.End(nil)
	if out := b.String(); !strings.Contains(out, "\r") || !strings.Contains(out, "\r\x1b[K✓ stage (") {
		t.Errorf("output %q", out)
	}
}

func TestRunToolErrorHasTail(t *testing.T) {
	err := runTool(context.Background(), nil, nil, "sh", "-c", "echo one; echo two >&2; exit 3")
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "one\n  two") {
		t.Errorf("err %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := runTool(ctx, nil, nil, "sleep", "5"); err != context.Canceled {
		t.Errorf("cancelled: %v", err)
	}
}

func TestMounts(t *testing.T) {
	if got := unescapeMount(`/a\040b/c`); got != "/a b/c" {
		t.Errorf("unescape: %q", got)
	}
	if m := mountsUnder("/proc"); len(m) == 0 {
		t.Skip("no /proc mount visible")
	}
	dir := t.TempDir()
	if m := mountsUnder(dir); m != nil {
		t.Errorf("mounts under a fresh temp dir: %v", m)
	}
	if err := removeBuildDir(dir); err != nil {
		t.Fatal(err)
	}
}

func TestAgentChecks(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "kvbox-agent")
	os.WriteFile(script, []byte("#!/bin/sh\n"), 0o755)
	if _, err := FindAgent(script); err == nil {
		t.Error("a script passed as the agent")
	}
	if _, err := FindAgent(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing agent passed")
	}
	if hasPVHNote(script) {
		t.Error("a script has a PVH note")
	}
}

func TestDebianDefaults(t *testing.T) {
	var o DebianOptions
	o.defaults()
	if o.Name != "debian" || o.Suite != "bookworm" || o.DiskSize != 8<<30 || !strings.HasPrefix(o.Mirror, "http://deb.debian.org/") {
		t.Errorf("defaults %+v", o)
	}
	for _, p := range []string{"linux-image-amd64", "systemd", "apt", "iproute2", "ca-certificates", "curl", "git", "python3"} {
		found := false
		for _, q := range DebianPackages {
			found = found || p == q
		}
		if !found {
			t.Errorf("package %s missing", p)
		}
	}
	if !strings.Contains(agentUnit, "Restart=always") || strings.Contains(agentUnit, "network-online") {
		t.Errorf("agent unit:\n%s", agentUnit)
	}
}

func TestAgentStamp(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	agent := filepath.Join(t.TempDir(), "kvbox-agent")
	os.WriteFile(agent, []byte("one"), 0o755)
	im := Image{Name: "debian", Created: time.Now().UTC()}
	if agentChanged(s, im, agent) {
		t.Error("changed without a stamp")
	}
	writeBuildStamp(s, im, agent, "r1")
	if agentChanged(s, im, agent) {
		t.Error("changed right after the build")
	}
	os.WriteFile(agent, []byte("two"), 0o755)
	if !agentChanged(s, im, agent) {
		t.Error("a new agent went unnoticed")
	}
	im.Created = im.Created.Add(time.Second) // another build: the stamp is not its
	if agentChanged(s, im, agent) {
		t.Error("stamp of another build used")
	}
}

// An image built from another recipe is built again; one built before
// recipes were recorded too; an imported one is left alone.
func TestRecipeChanged(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	agent := filepath.Join(t.TempDir(), "kvbox-agent")
	os.WriteFile(agent, []byte("one"), 0o755)
	im := Image{Name: "debian", Created: time.Now().UTC()}
	if recipeChanged(s, im, DebianRecipe(DebianOptions{})) {
		t.Error("an image with no build stamp (imported) counts as changed")
	}
	writeBuildStamp(s, im, agent, DebianRecipe(DebianOptions{}))
	if recipeChanged(s, im, DebianRecipe(DebianOptions{})) {
		t.Error("changed right after the build")
	}
	if !recipeChanged(s, im, DebianRecipe(DebianOptions{SSH: true})) {
		t.Error("the --ssh recipe is the plain one")
	}
	old, _ := json.Marshal(map[string]any{"created": im.Created, "agent_sha256": "x"})
	os.WriteFile(agentStampPath(s, im.Name), old, 0o644)
	if !recipeChanged(s, im, DebianRecipe(DebianOptions{})) {
		t.Error("a build from before recipes were recorded is not rebuilt")
	}
	if DebianRecipe(DebianOptions{}) == DebianRecipe(DebianOptions{Suite: "trixie"}) {
		t.Error("the suite is not part of the recipe")
	}
}
