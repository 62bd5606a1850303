package image

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/progress"
)

// reporter records what a build tells its progress.Reporter, one string
// a call.
type reporter struct {
	mu    sync.Mutex
	calls []string
}

func (r *reporter) add(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, s)
}

func (r *reporter) Log(line string) { r.add("log " + line) }

func (r *reporter) Stage(name string) progress.Stage {
	r.add("stage " + name)
	return reporterStage{r, name}
}

type reporterStage struct {
	r    *reporter
	name string
}

func (s reporterStage) Status(v string) { s.r.add(s.name + ": status " + v) }
func (s reporterStage) Bytes(done, total int64) {
	s.r.add(fmt.Sprintf("%s: bytes %d %d", s.name, done, total))
}
func (s reporterStage) End() { s.r.add(s.name + ": end") }

// A stage is a progress.Stage whose statuses are its tool's lines, ended
// before its line is logged: "✓ name (time)", or "✗ name (time)" when it
// failed, as fmtDur writes the time.
func TestStageLines(t *testing.T) {
	r := &reporter{}
	st := startStage(r, "first")
	if err := runTool(context.Background(), st, nil, "sh", "-c", "echo one; echo '  two  ' >&2"); err != nil {
		t.Fatal(err)
	}
	st.End(nil)
	st.End(nil) // a second End says nothing
	if err := startStage(r, "second").End(os.ErrNotExist); err != os.ErrNotExist {
		t.Errorf("End returned %v, not its error", err)
	}
	took := regexp.MustCompile(`\((\d\.\ds|\d\ds|\d+m\d\ds)\)$`)
	var got []string
	for _, c := range r.calls {
		got = append(got, took.ReplaceAllString(c, "(TIME)"))
	}
	want := []string{
		"stage first", "first: status one", "first: status two", "first: end", "log ✓ first (TIME)",
		"stage second", "second: end", "log ✗ second (TIME)",
	}
	if !slices.Equal(got, want) {
		t.Errorf("told\n%q\nwant\n%q", got, want)
	}
}

// A stage's time reads as it always did: tenths under ten seconds,
// seconds under a minute, then minutes and seconds.
func TestFmtDur(t *testing.T) {
	for d, want := range map[time.Duration]string{
		1500 * time.Millisecond: "1.5s", 42 * time.Second: "42s", 125 * time.Second: "2m05s",
	} {
		if got := fmtDur(d); got != want {
			t.Errorf("fmtDur(%v) = %q, want %q", d, got, want)
		}
	}
}

// The build's lines between stages are log lines too.
func TestLockBuildLogs(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	held, err := base.Lock(filepath.Join(s.Dir, ".build-debian.lock"), true)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Unlock()
	r := &reporter{}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := lockBuild(ctx, s, "debian", r); err == nil {
		t.Fatal("took a lock another holds")
	}
	if want := []string{"log another kvbox is building image debian: waiting for it"}; !slices.Equal(r.calls, want) {
		t.Errorf("told %q, want %q", r.calls, want)
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
	for _, p := range []string{"linux-image-amd64", "systemd", "apt", "iproute2", "ca-certificates", "curl", "git", "python3", "python-is-python3"} {
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

// A build of one image removes what killed builds of it left, and nothing
// of an image whose name starts with its own (debian, debian-ssh).
func TestRemoveStaleBuildsKeepsOtherImages(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	for _, d := range []string{".build-debian-123", ".build-debian-ssh-456"} {
		os.MkdirAll(filepath.Join(s.Dir, d, "root"), 0o755)
	}
	for _, f := range []string{".build-debian-ssh.agent.json", ".build-debian-ssh.lock", ".build-debian.agent.json"} {
		os.WriteFile(filepath.Join(s.Dir, f), []byte("{}"), 0o644)
	}
	removeStaleBuilds(s, "debian")
	for _, gone := range []string{".build-debian-123"} {
		if _, err := os.Stat(filepath.Join(s.Dir, gone)); err == nil {
			t.Errorf("%s left", gone)
		}
	}
	for _, kept := range []string{".build-debian-ssh-456", ".build-debian-ssh.agent.json", ".build-debian-ssh.lock", ".build-debian.agent.json"} {
		if _, err := os.Stat(filepath.Join(s.Dir, kept)); err != nil {
			t.Errorf("%s removed by a build of debian: %v", kept, err)
		}
	}
}
