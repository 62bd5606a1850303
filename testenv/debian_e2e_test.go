//go:build e2e

package testenv

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The default image: `kvbox images build debian` (a no-op when the image is
// there already: the first build takes minutes), then a box from it boots
// under libvirt to a running systemd, with the agent answering.
func TestDebianImage(t *testing.T) {
	if os.Getenv("KVBOX_E2E_SKIP_DEBIAN") != "" {
		t.Skip("KVBOX_E2E_SKIP_DEBIAN is set")
	}
	agent, err := filepath.Abs("../bin/kvbox-agent")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(agent); err != nil {
		t.Fatalf("%s: build it first (make build)", agent)
	}
	// A no-op when the image is there. Building downloads from
	// deb.debian.org, which this namespace cannot reach: testenv/setup.sh
	// builds it outside first.
	start := time.Now()
	r := kvbox(t, "images", "build", "debian", "--agent", agent)
	if r.code != 0 {
		t.Fatalf("kvbox images build debian: %s\nbuild the image outside the namespace %s first: bin/kvbox images build debian", r, testNetns)
	}
	t.Logf("images build debian (%.1fs):\n%s", time.Since(start).Seconds(), r.stdout)
	// Building again is a no-op.
	if out := mustKvbox(t, "images", "build", "debian", "--agent", agent); !strings.Contains(out, "already built") {
		t.Errorf("second build was not a no-op: %q", out)
	}
	var ims []struct {
		Name        string `json:"name"`
		Agent       string `json:"agent"`
		Kernel      string `json:"kernel"`
		VirtualSize int64  `json:"virtual_size_bytes"`
		SizeBytes   int64  `json:"size_bytes"`
	}
	if err := json.Unmarshal([]byte(mustKvbox(t, "images", "ls", "--json")), &ims); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, im := range ims {
		if im.Name == "debian" {
			found = true
			if im.Agent != "yes" || im.Kernel == "" || im.VirtualSize != 8<<30 {
				t.Errorf("images ls: %+v", im)
			}
			t.Logf("image debian: %d MiB virtual, %d MiB on disk", im.VirtualSize>>20, im.SizeBytes>>20)
		}
	}
	if !found {
		t.Fatal("image debian is not in kvbox images ls")
	}

	n := name(t, "deb")
	t.Cleanup(func() { kvbox(t, "rm", "--force", n) })
	start = time.Now()
	mustKvbox(t, "new", "--image", "debian", "--cpus", "2", "--memory", "1G", "--timeout", "240s", n)
	t.Logf("new from debian: agent ready after %.1fs", time.Since(start).Seconds())
	b := getBox(t, n)

	// The agent answers and exec works.
	if r := kvbox(t, "exec", n, "--", "uname", "-s"); r.code != 0 || r.stdout != "Linux\n" {
		t.Fatalf("exec uname: %s", r)
	}
	// The identity kvbox gave it, applied by the agent (nothing else
	// configures the network).
	got := inBox(t, n, "hostname; ip -4 -o addr show")
	for _, want := range []string{n, b.IP + "/24"} {
		if !strings.Contains(got, want) {
			t.Errorf("%q lacks %q", got, want)
		}
	}
	if r := kvbox(t, "exec", n, "--", "apt-get", "--version"); r.code != 0 || !strings.HasPrefix(r.stdout, "apt ") {
		t.Errorf("apt-get --version: %s", r)
	}
	if r := kvbox(t, "exec", n, "--", "python3", "-c", "print(1)"); r.code != 0 || r.stdout != "1\n" {
		t.Errorf("python3: %s", r)
	}
	// The user E2B code assumes: /home/user, /bin/bash, passwordless sudo.
	if r := kvbox(t, "exec", "--user", "user", n, "--", "/bin/bash", "-l", "-c", "id -u; id -un; echo $HOME; sudo -n id -u"); r.code != 0 || r.stdout != "1000\nuser\n/home/user\n0\n" {
		t.Errorf("the image's user: %s", r)
	}
	// systemd reaches "running": every unit started, none failed.
	start = time.Now()
	r = kvbox(t, "exec", n, "--", "timeout", "180", "systemctl", "is-system-running", "--wait")
	t.Logf("systemctl is-system-running --wait: %q after %.1fs more", strings.TrimSpace(r.stdout), time.Since(start).Seconds())
	if strings.TrimSpace(r.stdout) != "running" {
		failed := kvbox(t, "exec", n, "--", "systemctl", "--failed", "--no-pager")
		t.Errorf("systemd is %q, not running: %s\nfailed units:\n%s", strings.TrimSpace(r.stdout), r, failed.stdout)
	}
	// The agent is a systemd service, restarted if it dies.
	if s := strings.TrimSpace(inBox(t, n, "systemctl is-active kvbox-agent")); s != "active" {
		t.Errorf("kvbox-agent service is %q", s)
	}
	// dpkg syncs as usual for what users install: the build's unsafe-io
	// setting is not in the image.
	if got := strings.TrimSpace(inBox(t, n, "grep -rl unsafe-io /etc/dpkg/dpkg.cfg /etc/dpkg/dpkg.cfg.d || true")); got != "" {
		t.Errorf("the image's dpkg configuration still has unsafe-io: %s", got)
	}
	// root's password is locked: no user in the box can su to root.
	if pw := strings.TrimSpace(inBox(t, n, "getent shadow root | cut -d: -f2")); pw != "*" && !strings.HasPrefix(pw, "!") {
		t.Errorf("root's password field is %q, want locked (* or !)", pw)
	}
}
