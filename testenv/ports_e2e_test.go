//go:build e2e

package testenv

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"kvbox.dev/kvbox/testenv/gate"
)

// forwardProc is a running `kvbox port-forward`.
type forwardProc struct {
	cmd    *exec.Cmd
	addrs  []string // host addresses, in the order of the specs
	stderr *syncWriter
	done   chan error
}

var forwardingLine = regexp.MustCompile(`^forwarding (\S+) -> `)

// portForward starts `kvbox port-forward BOX SPEC...` and waits for its
// "forwarding" lines.
func portForward(t *testing.T, boxName string, specs ...string) *forwardProc {
	t.Helper()
	cmd := exec.Command(kvboxBin, append([]string{"port-forward", boxName}, specs...)...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &forwardProc{cmd: cmd, stderr: &syncWriter{w: &strings.Builder{}}, done: make(chan error, 1)}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); <-p.done })
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		p.done <- cmd.Wait()
	}()
	for len(p.addrs) < len(specs) {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("port-forward ended before forwarding: %s", p.stderr)
			}
			if m := forwardingLine.FindStringSubmatch(l); m != nil {
				p.addrs = append(p.addrs, m[1])
			}
		case <-time.After(60 * time.Second):
			t.Fatalf("port-forward did not start: %s", p.stderr)
		}
	}
	go func() {
		for range lines {
		}
	}()
	return p
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(b)
}

func (s *syncWriter) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprint(s.w)
}

// fwdGet fetches url on a fresh connection.
func fwdGet(url string) ([]byte, error) {
	c := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != 200 {
		err = fmt.Errorf("%s: %s", url, resp.Status)
	}
	return b, err
}

// startWebServer runs busybox httpd on port in the box with an index page
// and a 4 MB random file; it returns the page and the file's sha256.
func startWebServer(t *testing.T, n string, port int) (page, bigSum string) {
	t.Helper()
	page = "page-of-" + n
	out := inBox(t, n, fmt.Sprintf("mkdir -p /www && echo %s > /www/index.html && "+
		"dd if=/dev/urandom of=/www/big bs=1M count=4 2>/dev/null && sha256sum /www/big && "+
		"setsid httpd -p %d -h /www </dev/null >/dev/null 2>&1; sleep 0.3; netstat -ltn | grep -q :%d", page, port, port))
	return page + "\n", strings.Fields(out)[0]
}

func parallelGets(t *testing.T, url, want string, n int) {
	t.Helper()
	errs := make(chan error, n)
	parallel(n, func(i int) {
		b, err := fwdGet(url)
		if err == nil && string(b) != want {
			err = fmt.Errorf("got %q", b)
		}
		errs <- err
	})
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("request through the forward: %v", err)
		}
	}
}

// TestPortForward: 20 parallel HTTP requests through `kvbox port-forward`
// to busybox httpd in a tiny box, a 4 MB download, a refused guest port,
// the same with the box's network down (the agent channel needs none),
// and the forward ending with one line when the box is removed.
func TestPortForward(t *testing.T) {
	n := name(t, "pf")
	b := newBox(t, n)
	page, bigSum := startWebServer(t, n, 8000)

	pf := portForward(t, n, "0:8000", "127.0.0.1:0:9") // nothing listens on 9
	if !strings.HasPrefix(pf.addrs[0], "127.0.0.1:") {
		t.Errorf("default bind address: %s", pf.addrs[0])
	}
	url := "http://" + pf.addrs[0]
	parallelGets(t, url+"/index.html", page, 20)
	big, err := fwdGet(url + "/big")
	if err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(big); hex.EncodeToString(sum[:]) != bigSum {
		t.Errorf("4 MB through the forward: %d bytes, checksum differs", len(big))
	}

	// A guest port nobody listens on: the connection is closed, one line.
	c, err := net.Dial("tcp", pf.addrs[1])
	if err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Errorf("read %d bytes from a refused guest port", n)
	}
	c.Close()
	eventually(t, 10*time.Second, func() error {
		if !strings.Contains(pf.stderr.String(), "connection refused") {
			return fmt.Errorf("no line for the refused port: %q", pf.stderr.String())
		}
		return nil
	})

	// The box without a network: its link down, a direct connection fails,
	// the forward still works.
	inBox(t, n, "ip link set eth0 down")
	if d, err := net.DialTimeout("tcp", b.IP+":8000", 2*time.Second); err == nil {
		d.Close()
		t.Fatalf("direct connection to %s:8000 with the box's link down", b.IP)
	}
	parallelGets(t, url+"/index.html", page, 20)

	// Removing the box ends the forward with one line and closes its ports.
	mustKvbox(t, "rm", "--force", n)
	select {
	case err := <-pf.done:
		if err == nil {
			t.Error("port-forward exited 0 after its box was removed")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("port-forward still runs after its box was removed")
	}
	if !strings.Contains(pf.stderr.String(), fmt.Sprintf("box %q was removed: port forwarding ended", n)) {
		t.Errorf("stderr after rm: %q", pf.stderr.String())
	}
	if c, err := net.DialTimeout("tcp", pf.addrs[0], time.Second); err == nil {
		c.Close()
		t.Error("the forward's port still listens after the box was removed")
	}
	pf.done <- nil // for the cleanup
}

// publishedOf is a box's published ports in ls --json.
func publishedOf(t *testing.T, n string) []string {
	t.Helper()
	var bs []struct {
		Name      string `json:"name"`
		Published []struct {
			Address  string `json:"address"`
			HostPort int    `json:"host_port"`
		} `json:"published"`
	}
	if err := json.Unmarshal([]byte(mustKvbox(t, "ls", "--json")), &bs); err != nil {
		t.Fatal(err)
	}
	for _, b := range bs {
		if b.Name == n {
			var out []string
			for _, p := range b.Published {
				out = append(out, net.JoinHostPort(p.Address, fmt.Sprint(p.HostPort)))
			}
			return out
		}
	}
	t.Fatalf("box %s not listed", n)
	return nil
}

func listening(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err == nil {
		c.Close()
	}
	return err == nil
}

// TestPublish: new --publish keeps a forward while the box lives, lists it
// in ls --json, refuses a taken port before creating anything, survives
// stop/start, and nothing listens after rm.
func TestPublish(t *testing.T) {
	// A taken host port: refused with one line, no box made.
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	nt := name(t, "pubtaken")
	r := kvbox(t, append(append([]string{"new"}, smallBox...), "--publish", taken.Addr().String()+":8000", nt)...)
	if r.code == 0 || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 || !strings.Contains(r.stderr, "address already in use") {
		t.Errorf("new --publish on a taken port: %s", r)
	}
	if out, _ := virsh("dominfo", nt); !strings.Contains(out, "failed to get domain") {
		t.Errorf("a box was made for a refused --publish: %s", out)
	}

	n := name(t, "pub")
	newBox(t, n, "--publish", "0:8000")
	pub := publishedOf(t, n)
	if len(pub) != 1 || !strings.HasPrefix(pub[0], "127.0.0.1:") {
		t.Fatalf("published = %v", pub)
	}
	page, _ := startWebServer(t, n, 8000)
	parallelGets(t, "http://"+pub[0]+"/index.html", page, 20)

	// stop ends the holder, start brings the same port back.
	mustKvbox(t, "stop", "--force", n)
	if listening(pub[0]) {
		t.Error("published port listens while the box is stopped")
	}
	if out := mustKvbox(t, "start", n); !strings.Contains(out, "published "+pub[0]) {
		t.Errorf("start: %s", out)
	}
	page, _ = startWebServer(t, n, 8000)
	if b, err := fwdGet("http://" + pub[0] + "/index.html"); err != nil || string(b) != page {
		t.Errorf("after stop/start: %q %v", b, err)
	}

	holder := holderPID(t, n)
	mustKvbox(t, "rm", "--force", n)
	if listening(pub[0]) {
		t.Error("published port still listens after rm")
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/cmdline", holder)); err == nil {
		if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", holder)); len(b) > 0 {
			t.Errorf("the holder (pid %d) still runs after rm: %q", holder, b)
		}
	}
}

func holderPID(t *testing.T, n string) int {
	t.Helper()
	// Root's, under the state dir: not in the box's folder, which QEMU's
	// user can write.
	raw, err := os.ReadFile(filepath.Join(stateDir, "publish", n+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		PID int `json:"pid"`
	}
	json.Unmarshal(raw, &rec)
	if rec.PID <= 0 {
		t.Fatalf("publish/%s.json: %s", n, raw)
	}
	return rec.PID
}

// sshImage is the Debian image with openssh-server (setup.sh builds it:
// kvbox images build debian --ssh --name debian-ssh).
const sshImage = "debian-ssh"

// sshRun runs a command in the box over ssh through kvbox ssh-proxy, with
// its own known_hosts file, and returns the output and the host key ssh
// saw.
func sshRun(t *testing.T, cfg, boxName, knownHosts string, command ...string) (string, string, error) {
	t.Helper()
	args := append([]string{"-F", cfg, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
		"-o", "UserKnownHostsFile=" + knownHosts, "-o", "ConnectTimeout=60", boxName}, command...)
	var stderr strings.Builder
	cmd := exec.Command("ssh", args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		err = fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr.String()))
	}
	kh, _ := os.ReadFile(knownHosts)
	f := strings.Fields(string(kh))
	key := ""
	if len(f) >= 3 {
		key = f[1] + " " + f[2]
	}
	return string(out), key, err
}

// TestSSHProxy: ssh through `kvbox ssh-proxy` (the entries of `kvbox
// ssh-config`) to a box of the Debian image with ssh runs a command; the
// box presents its own host key, and two clones of it each present a new
// one, all different.
func TestSSHProxy(t *testing.T) {
	gate.Tools(t, "ssh")
	if r := kvbox(t, "images", "ls"); !strings.Contains(r.stdout, sshImage) {
		t.Fatalf("image %s is missing: bash testenv/setup.sh builds it (kvbox images build debian --ssh --name %s)", sshImage, sshImage)
	}
	src := name(t, "sshsrc")
	t.Cleanup(func() { kvbox(t, "rm", "--force", src) })
	mustKvbox(t, "new", "--image", sshImage, "--cpus", "2", "--memory", "1G", "--timeout", "240s", src)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config")
	conf := mustKvbox(t, "ssh-config", src)
	if !strings.Contains(conf, "ProxyCommand "+kvboxBin) || !strings.Contains(conf, "Host "+src) {
		t.Fatalf("ssh-config: %s", conf)
	}
	os.WriteFile(cfg, []byte(conf), 0o600)

	var out, key string
	eventually(t, 120*time.Second, func() error { // sshd starts after the agent answers
		var err error
		out, key, err = sshRun(t, cfg, src, filepath.Join(dir, "kh-src"), "hostname")
		if err != nil {
			os.Remove(filepath.Join(dir, "kh-src"))
			return fmt.Errorf("ssh: %v: %s", err, out)
		}
		return nil
	})
	if strings.TrimSpace(out) != src {
		t.Errorf("hostname over ssh: %q", out)
	}
	inKey := strings.Join(strings.Fields(inBox(t, src, "cat /etc/ssh/ssh_host_ed25519_key.pub"))[:2], " ")
	if key != inKey {
		t.Errorf("ssh saw %q, the box has %q", key, inKey)
	}

	snap := name(t, "sshsnap")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)
	keys := map[string]string{key: src}
	for i := 1; i <= 2; i++ {
		c := name(t, fmt.Sprintf("sshc%d", i))
		t.Cleanup(func() { kvbox(t, "rm", "--force", c) })
		mustKvbox(t, "new", "--from", snap, c)
		conf := mustKvbox(t, "ssh-config", c)
		os.WriteFile(cfg, []byte(conf), 0o600)
		out, key, err := sshRun(t, cfg, c, filepath.Join(dir, "kh-"+c), "hostname")
		if err != nil || strings.TrimSpace(out) != c {
			diag := kvbox(t, "exec", c, "--", "sh", "-c", "ss -ltnp; systemctl status --no-pager ssh; journalctl --no-pager -n 80")
			t.Fatalf("ssh to clone %s: %v: %s\nin the clone:\n%s", c, err, out, diag)
		}
		if other, dup := keys[key]; dup || key == "" {
			t.Errorf("clone %s presents host key %q, the same as %s", c, key, other)
		}
		keys[key] = c
	}
}

// A box with no network at all (--network none) is reached through its
// agent: 20 parallel requests to a server in it through port-forward.
func TestPortForwardNoNetwork(t *testing.T) {
	n := name(t, "pfnonet")
	b := newBox(t, n, "--network", "none")
	if b.IP != "" || b.Tap != "" {
		t.Fatalf("a --network none box has an address %q or a port %q", b.IP, b.Tap)
	}
	if out := inBox(t, n, "ls /sys/class/net | grep -v '^lo$' || true"); strings.TrimSpace(out) != "" {
		t.Fatalf("a --network none box has interfaces: %q", out)
	}
	page, _ := startWebServer(t, n, 8000)
	pf := portForward(t, n, "0:8000")
	parallelGets(t, "http://"+pf.addrs[0]+"/index.html", page, 20)
	mustKvbox(t, "rm", "--force", n)
	select {
	case <-pf.done:
	case <-time.After(30 * time.Second):
		t.Fatal("port-forward still runs after its box was removed")
	}
	pf.done <- nil // for the cleanup
}
