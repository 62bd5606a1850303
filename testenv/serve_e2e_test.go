//go:build e2e

package testenv

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
)

// serveProc is a kvbox serve the test started.
type serveProc struct {
	cmd  *exec.Cmd
	addr string // host:port it listens on
	out  *bytes.Buffer
}

var serveURLRe = regexp.MustCompile(`E2B's API on https?://([0-9.]+:[0-9]+)`)

// startServe starts kvbox serve on listen (127.0.0.1:0 for a free port)
// with the global flags given (then, after a "--", serve's own), and waits
// for the line naming its address.
func startServe(t *testing.T, listen string, flags ...string) *serveProc {
	t.Helper()
	var out bytes.Buffer
	var own []string
	if i := slices.Index(flags, "--"); i >= 0 {
		flags, own = flags[:i], flags[i+1:]
	}
	cmd := exec.Command(kvboxBin, append(append(flags, "serve", "--listen", listen), own...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &serveProc{cmd: cmd, out: &out}
	t.Cleanup(func() { p.kill(); t.Logf("kvbox serve's log:\n%s", out.String()) })
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	timeout := time.After(2 * time.Minute)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("kvbox serve ended before it listened:\n%s", out.String())
			}
			if m := serveURLRe.FindStringSubmatch(l); m != nil {
				p.addr = m[1]
				go func() {
					for range lines {
					}
				}()
				return p
			}
		case <-timeout:
			t.Fatalf("kvbox serve did not say where it listens:\n%s", out.String())
		}
	}
}

// kill ends serve as a crash would (SIGKILL) and waits for it.
func (p *serveProc) kill() {
	if p.cmd.ProcessState == nil {
		p.cmd.Process.Signal(syscall.SIGKILL)
		p.cmd.Wait()
	}
}

// serveTemplate makes a template of the Debian image whose HTTP server
// runs on port 8000, serving page: a box, its server started, snapshotted;
// the box goes, the template when the test ends (after every sandbox
// made from it, which cleanupSandboxes removes).
func serveTemplate(t *testing.T, page string, flags ...string) string {
	t.Helper()
	src, snap := name(t, "srvsrc"), name(t, "srvwarm")
	t.Cleanup(func() { kvbox(t, append(flags, "snapshots", "rm", snap)...) })
	t.Cleanup(func() { kvbox(t, append(flags, "rm", "--force", src)...) })
	mustKvbox(t, append(flags, "new", "--image", "debian", "--cpus", "2", "--memory", "1G", "--timeout", "300s", src)...)
	inBox(t, src, fmt.Sprintf("mkdir -p /srv/www && printf %%s '%s' > /srv/www/index.html && cd /srv/www && setsid python3 -m http.server 8000 >/dev/null 2>&1 </dev/null &", page))
	eventually(t, 2*time.Minute, func() error {
		r := kvbox(t, "exec", src, "--", "curl", "-sf", "http://127.0.0.1:8000/")
		if r.code != 0 || r.stdout != page {
			return fmt.Errorf("the template's server: %s", r)
		}
		return nil
	})
	mustKvbox(t, append(flags, "snapshots", "new", src, snap)...)
	mustKvbox(t, append(flags, "rm", "--force", src)...)
	return snap
}

// cleanupSandboxes removes, when the test ends, every sandbox serve made
// from template and every fork snapshot no box is cloned from any more
// (a fork's waits for its TTL otherwise).
func cleanupSandboxes(t *testing.T, template string) {
	t.Cleanup(func() {
		var bs []struct {
			Name     string            `json:"name"`
			Snapshot string            `json:"snapshot"`
			Labels   map[string]string `json:"labels"`
		}
		if err := json.Unmarshal([]byte(kvbox(t, "ls", "--json").stdout), &bs); err != nil {
			t.Errorf("kvbox ls --json: %v", err)
		}
		var names []string
		for _, b := range bs {
			if v, ok := b.Labels["e2b.template"]; ok && (v == template || strings.HasPrefix(b.Snapshot, "e2bfork-") || strings.HasPrefix(b.Snapshot, "snap-")) {
				names = append(names, b.Name)
			}
		}
		if len(names) > 0 {
			t.Logf("removing %d sandboxes left: %v", len(names), names)
			kvbox(t, append([]string{"rm", "--force"}, names...)...)
		}
		var snaps []struct {
			Name   string   `json:"name"`
			Clones []string `json:"clones"`
		}
		json.Unmarshal([]byte(kvbox(t, "snapshots", "ls", "--json").stdout), &snaps)
		for _, s := range snaps {
			if strings.HasPrefix(s.Name, "e2bfork-") && len(s.Clones) == 0 {
				kvbox(t, "snapshots", "rm", s.Name)
			}
		}
	})
}

// noLeftovers checks that the sandboxes an SDK's run made left nothing
// once it killed them: no fork snapshot (each goes with its last fork),
// no box folder without its box (a kill's removal raced by another kvbox
// left one).
func noLeftovers(t *testing.T) {
	t.Helper()
	var snaps []struct {
		Name   string   `json:"name"`
		Clones []string `json:"clones"`
	}
	json.Unmarshal([]byte(mustKvbox(t, "snapshots", "ls", "--json")), &snaps)
	for _, sn := range snaps {
		if strings.HasPrefix(sn.Name, "e2bfork-") {
			t.Errorf("fork snapshot %s outlives its forks (clones now: %v)", sn.Name, sn.Clones)
		}
	}
	// A removal under way (a reaper's) has its box undefined before its
	// folder goes: the folders are looked at again for a while.
	eventually(t, 2*time.Minute, func() error {
		have := map[string]bool{}
		for _, b := range listBoxes(t) {
			have[b.Name] = true
		}
		ents, _ := os.ReadDir(filepath.Join(stateDir, "boxes"))
		for _, e := range ents {
			if !have[e.Name()] {
				return fmt.Errorf("a box folder without its box: %s", filepath.Join(stateDir, "boxes", e.Name()))
			}
		}
		return nil
	})
}

// runNode runs a script of testenv/e2b with SDK version v against serve.
func runNode(t *testing.T, v string, p *serveProc, template, page string, env []string, args ...string) error {
	t.Helper()
	repo, _ := filepath.Abs("..")
	key := strings.TrimSpace(mustKvbox(t, "serve", "key"))
	url := "http://" + p.addr
	cmd := exec.Command("node", args...)
	cmd.Dir = t.TempDir()
	cmd.Env = append(os.Environ(),
		"E2B_SDK_DIR="+filepath.Join(envdtest.Dir(repo), v),
		"E2B_API_URL="+url, "E2B_SANDBOX_URL="+url, "E2B_API_KEY="+key,
		"KVBOX_TEMPLATE="+template, "KVBOX_TEMPLATE_PAGE="+page, "KVBOX_SERVE_ADDR="+p.addr,
		"NO_PROXY=*", "HTTP_PROXY=", "HTTPS_PROXY=", "http_proxy=", "https_proxy=")
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	t.Logf("node %s (e2b@%s):\n%s", strings.Join(args, " "), v, out)
	return err
}

// TestServe: the real, unmodified E2B SDK (both pinned versions) against
// kvbox serve, on warm clones of a Debian template with a server started
// before its snapshot: every call the issue lists (serve.test.mjs); what a
// snapshot copies opening nothing (secretsStep); then serve killed in the middle and started again, with nothing lost and a
// sandbox that timed out meanwhile gone (serve-restart.mjs); then serve
// over TLS, the SDK with its defaults for the sandbox's traffic
// (servetls_e2e_test.go).
func TestServe(t *testing.T) {
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range envdtest.Versions {
		if p, ok := envdtest.Installed(repo, v); !ok {
			t.Fatalf("%s missing: run testenv/setup.sh (it installs the pinned E2B SDKs)", p)
		}
	}
	var ims []struct{ Name string }
	json.Unmarshal([]byte(mustKvbox(t, "images", "ls", "--json")), &ims)
	if !slices.ContainsFunc(ims, func(im struct{ Name string }) bool { return im.Name == "debian" }) {
		t.Fatalf("the Debian image is not registered in %s: bin/kvbox --state-dir %s images build debian (in the root namespace) first", stateDir, stateDir)
	}
	page := "<h1>served by the template " + runID + "</h1>"
	template := serveTemplate(t, page)
	cleanupSandboxes(t, template)
	p := startServe(t, "127.0.0.1:0")

	// The API's answers without the SDK: health, and the key checked.
	resp, err := http.Get("http://" + p.addr + "/health")
	if err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("GET /health: %v %v", resp, err)
	}
	resp, err = http.Get("http://" + p.addr + "/v2/sandboxes")
	if err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(b), `"code":401`) {
			t.Errorf("a list without a key: %d %s", resp.StatusCode, b)
		}
	}

	for _, v := range envdtest.Versions {
		t.Run("e2b@"+v, func(t *testing.T) {
			if err := runNode(t, v, p, template, page, nil, "--test-reporter=spec", "--test-force-exit", filepath.Join(envdtest.Dir(repo), "serve.test.mjs")); err != nil {
				t.Fatalf("the SDK's run against kvbox serve failed: %v", err)
			}
			noLeftovers(t)
		})
	}

	t.Run("secrets", func(t *testing.T) { secretsStep(t, p, template, page) })
	t.Run("busy box", func(t *testing.T) { busyBoxStep(t, p, template) })

	t.Run("restart", func(t *testing.T) {
		v := envdtest.Versions[0]
		state := filepath.Join(t.TempDir(), "state.json")
		script := filepath.Join(envdtest.Dir(repo), "serve-restart.mjs")
		if err := runNode(t, v, p, template, page, []string{"KVBOX_PHASE=before", "KVBOX_STATE_FILE=" + state}, script); err != nil {
			t.Fatalf("before the restart: %v", err)
		}
		var st struct {
			Short    string `json:"short"`
			ShortEnd int64  `json:"shortEnd"`
		}
		b, _ := os.ReadFile(state)
		if err := json.Unmarshal(b, &st); err != nil {
			t.Fatal(err)
		}
		p.kill()
		// The short sandbox times out while serve is down: its reaper, not
		// serve, removes it.
		eventually(t, 3*time.Minute, func() error {
			for _, b := range listBoxes(t) {
				if b.Name == st.Short {
					return fmt.Errorf("sandbox %s (timeout at %s) is still there", st.Short, time.UnixMilli(st.ShortEnd).Format(time.RFC3339))
				}
			}
			return nil
		})
		p2 := startServe(t, p.addr)
		if err := runNode(t, v, p2, template, page, []string{"KVBOX_PHASE=after", "KVBOX_STATE_FILE=" + state}, script); err != nil {
			t.Fatalf("after the restart: %v", err)
		}
		p2.kill()
	})

	t.Run("tls", func(t *testing.T) { tlsStep(t, p.addr, template, page) })
}
