package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"kvbox.dev/kvbox/image"
)

// serveSDK is the version of the E2B SDK the serve section drives, and
// servePySDK that of the Python SDK (testenv/e2b-py/V, its virtualenv in
// the test environment's cache).
const (
	serveSDK   = "2.51.0"
	servePySDK = "2.63.0"
)

// firstCommand is what the SDK's commands.run('true') runs in the guest:
// every command it runs is an argument of a login shell. The CLI runs the
// same, so the two differ only by the way there.
var firstCommand = []string{"/bin/bash", "-l", "-c", "true"}

// execFirst runs firstCommand in box name through the CLI.
func execFirst(ctx context.Context, e *env, name string) (time.Duration, error) {
	return e.kvboxCLI(ctx, append([]string{"exec", name, "--"}, firstCommand...)...)
}

// benchServe times, in one run, a sandbox through E2B's SDK against kvbox
// serve (Sandbox.create, and create to the first command's end) against
// the CLI's warm clone and exec (new --from, then the SDK's first command)
// and a cold boot of the image (new --image, the same), all of the Debian template with a
// server running; then ten creates at once through the SDK against the
// CLI's new --count 10. SDK and CLI alternate, so the machine's load
// weighs on both alike.
func benchServe(ctx context.Context, e *env) error {
	im, err := (image.Store{Dir: e.stateDir + "/images"}).Get("debian")
	if err != nil {
		return fmt.Errorf("the Debian image: %w (make testenv builds it)", err)
	}
	sdk := filepath.Join("testenv", "e2b", serveSDK)
	if _, err := os.Stat(filepath.Join(sdk, "node_modules", "e2b")); err != nil {
		return fmt.Errorf("the E2B SDK %s: %w (make testenv installs it)", serveSDK, err)
	}
	tmpl, err := serveTemplate(ctx, e, im.Name)
	if err != nil {
		return err
	}
	srv, addr, err := startServe(ctx, e)
	if err != nil {
		return err
	}
	defer srv.stop()
	node, err := startSDK(ctx, e, sdk, addr, tmpl)
	if err != nil {
		return err
	}
	defer node.stop()
	py := filepath.Join(envOr("KVBOX_TESTENV_CACHE", "/var/cache/kvbox-testenv"), "e2b-py", servePySDK, "bin", "python")
	if _, err := os.Stat(py); err != nil {
		return fmt.Errorf("the E2B Python SDK %s: %w (make testenv installs it)", servePySDK, err)
	}
	pyd, err := startDriver(ctx, e, addr, []string{py, "-I", filepath.Join("testenv", "e2b-py", "bench.py")}, "KVBOX_TEMPLATE="+tmpl)
	if err != nil {
		return err
	}
	defer pyd.stop()

	var t serveTimes
	if err := t.sdkAndCLI(ctx, e, node, pyd, tmpl); err != nil {
		return err
	}
	if err := t.coldBoots(ctx, e, im.Name); err != nil {
		return err
	}
	if err := t.tenAtOnce(ctx, e, node, tmpl); err != nil {
		return err
	}
	t.print(e, im.Name)
	return nil
}

// serveTemplate is the template: a Debian box at the image's size with a
// server started, frozen; the box goes, the template when the bench ends.
func serveTemplate(ctx context.Context, e *env, img string) (string, error) {
	src, tmpl := "bench-srv-src", "bench-srv-warm"
	if _, err := e.kvboxCLI(ctx, "new", "--image", img, "--timeout", "300s", src); err != nil {
		return "", err
	}
	defer e.kvboxCLI(context.Background(), "rm", "--force", src)
	if _, err := e.kvboxCLI(ctx, "exec", src, "--", "sh", "-c",
		"mkdir -p /srv/www && echo bench > /srv/www/index.html && cd /srv/www && setsid python3 -m http.server 8000 >/dev/null 2>&1 </dev/null & "+
			"for i in $(seq 300); do curl -sf localhost:8000/ >/dev/null && exit 0; sleep 0.2; done; exit 1"); err != nil {
		return "", err
	}
	if _, err := e.kvboxCLI(ctx, "snapshots", "new", src, tmpl); err != nil {
		return "", err
	}
	e.cleanup = append(e.cleanup, func() { e.k.RemoveSnapshot(context.Background(), tmpl) })
	if _, err := e.kvboxCLI(ctx, "rm", "--force", src); err != nil {
		return "", err
	}
	return tmpl, nil
}

// serveTimes is what the serve section measured.
type serveTimes struct {
	sdkCreate, sdkFirst, cliClone, cliFirst []time.Duration
	pyCreate, pyFirst                       []time.Duration
	cold                                    []time.Duration
	many                                    sdkMany
	cliMany                                 time.Duration
}

// cliTimes is one warm clone through the CLI: new --from, and that with
// firstCommand after it.
type cliTimes struct{ clone, first time.Duration }

// cliWarm times one warm clone of tmpl and a first command in it through
// the CLI; the box goes after.
func cliWarm(ctx context.Context, e *env, tmpl string, i int) (cliTimes, error) {
	name := fmt.Sprintf("bench-srv-cli-%d", i)
	defer e.kvboxCLI(context.Background(), "rm", "--force", name)
	// The SDK's sandboxes have the deadline bench.mjs asks for (its
	// timeoutMs): the CLI's clones get the same, and with it a reaper each.
	clone, err := e.kvboxCLI(ctx, "new", "--from", tmpl, "--ttl", "10m", name)
	if err != nil {
		return cliTimes{}, err
	}
	exec, err := execFirst(ctx, e, name)
	return cliTimes{clone, clone + exec}, err
}

// sdkAndCLI times e.n sandboxes through the JS SDK, each followed by one
// through the Python SDK and a warm clone through the CLI, after a first
// of each that is not counted (page cache, the SDKs' connections).
func (t *serveTimes) sdkAndCLI(ctx context.Context, e *env, node, pyd *sdkProc, tmpl string) error {
	if _, err := node.one(); err != nil {
		return err
	}
	if _, err := pyd.one(); err != nil {
		return err
	}
	if _, err := cliWarm(ctx, e, tmpl, -1); err != nil {
		return err
	}
	for i := range e.n {
		r, err := node.one()
		if err != nil {
			return err
		}
		t.sdkCreate, t.sdkFirst = append(t.sdkCreate, r.create), append(t.sdkFirst, r.first)
		p, err := pyd.one()
		if err != nil {
			return err
		}
		t.pyCreate, t.pyFirst = append(t.pyCreate, p.create), append(t.pyFirst, p.first)
		c, err := cliWarm(ctx, e, tmpl, i)
		if err != nil {
			return err
		}
		t.cliClone, t.cliFirst = append(t.cliClone, c.clone), append(t.cliFirst, c.first)
	}
	return nil
}

// coldBoots times e.boots cold boots of the image and a first command in
// each; each box goes after.
func (t *serveTimes) coldBoots(ctx context.Context, e *env, img string) error {
	for i := range e.boots {
		name := fmt.Sprintf("bench-srv-cold-%d", i)
		boot, err := e.kvboxCLI(ctx, "new", "--image", img, "--timeout", "300s", name)
		if err == nil {
			var ex time.Duration
			ex, err = execFirst(ctx, e, name)
			boot += ex
		}
		e.kvboxCLI(context.Background(), "rm", "--force", name)
		if err != nil {
			return err
		}
		t.cold = append(t.cold, boot)
	}
	return nil
}

// tenAtOnce times ten creates at once through the SDK, then the CLI's new
// --from --count 10 (its boxes removed after).
func (t *serveTimes) tenAtOnce(ctx context.Context, e *env, node *sdkProc, tmpl string) error {
	many, err := node.many(10)
	if err != nil {
		return err
	}
	t.many = many
	t0 := time.Now()
	_, err = e.kvboxCLI(ctx, "new", "--from", tmpl, "--ttl", "10m", "--count", "10", "bench-srv-many")
	t.cliMany = time.Since(t0)
	names := []string{"rm", "--force"}
	for i := 1; i <= 10; i++ {
		names = append(names, fmt.Sprintf("bench-srv-many-%d", i))
	}
	e.kvboxCLI(context.Background(), names...)
	return err
}

// print prints the serve section: medians and 90th percentiles, the SDK's
// cost over the CLI's, and the ratios.
func (t *serveTimes) print(e *env, img string) {
	sdkCreate, sdkFirst, cliClone, cliFirst, cold, many, cliMany := t.sdkCreate, t.sdkFirst, t.cliClone, t.cliFirst, t.cold, t.many, t.cliMany
	row := func(what string, ds []time.Duration) {
		fmt.Printf("  %-44s %7.0f ms %7.0f ms\n", what, ms(pct(ds, 50)), ms(pct(ds, 90)))
	}
	fmt.Printf("Debian template (%s), a server running; %d of each, the SDKs and the CLI alternated; e2b %s (JS) and %s (Python) over kvbox serve\n", img, e.n, serveSDK, servePySDK)
	fmt.Printf("  %-44s %10s %10s\n", "", "p50", "p90")
	row("SDK Sandbox.create", sdkCreate)
	row("SDK create to the first command's end", sdkFirst)
	row("Python SDK Sandbox.create", t.pyCreate)
	row("Python SDK create to the first command's end", t.pyFirst)
	row("CLI kvbox new --from --ttl 10m", cliClone)
	row("CLI new --from, then exec bash -l -c true", cliFirst)
	row(fmt.Sprintf("cold boot: new --image, then the same (%d)", len(cold)), cold)
	d := pct(sdkFirst, 50) - pct(cliFirst, 50)
	fmt.Printf("SDK create to first command minus CLI clone + exec, p50: %+.0f ms (target: at most +150 ms); p90: %+.0f ms\n",
		ms(d), ms(pct(sdkFirst, 90)-pct(cliFirst, 90)))
	fmt.Printf("Python SDK create to first command minus CLI clone + exec, p50: %+.0f ms; p90: %+.0f ms\n",
		ms(pct(t.pyFirst, 50)-pct(cliFirst, 50)), ms(pct(t.pyFirst, 90)-pct(cliFirst, 90)))
	fmt.Printf("ratio cold boot / SDK create to first command (p50): %.1fx\n", float64(pct(cold, 50))/float64(pct(sdkFirst, 50)))
	fmt.Printf("10 creates at once through the SDK: all ten at their first command's end in %.0f ms; each create p50 %.0f ms, p90 %.0f ms\n",
		ms(many.wall), ms(pct(many.creates, 50)), ms(pct(many.creates, 90)))
	fmt.Printf("peer: kvbox new --from --ttl 10m --count 10: %.0f ms\n", ms(cliMany))
}

// serveProc is the kvbox serve the section runs.
type serveProc struct{ cmd *exec.Cmd }

func (p *serveProc) stop() {
	p.cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-done
	}
}

var serveAddrRe = regexp.MustCompile(`E2B's API on http://([0-9.]+:[0-9]+)`)

// startServe starts bin/kvbox serve on a free loopback port.
func startServe(ctx context.Context, e *env) (*serveProc, string, error) {
	cmd := exec.CommandContext(ctx, "bin/kvbox", "--state-dir", e.stateDir, "serve", "--listen", "127.0.0.1:0")
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	p := &serveProc{cmd}
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if m := serveAddrRe.FindStringSubmatch(sc.Text()); m != nil {
			go io.Copy(io.Discard, out)
			return p, m[1], nil
		}
	}
	p.stop()
	return nil, "", fmt.Errorf("kvbox serve ended before it listened")
}

// sdkProc is an SDK's side of a section (testenv/e2b/bench.mjs, a bench.py), driven a line at a time.
type sdkProc struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

func startSDK(ctx context.Context, e *env, sdk, addr, tmpl string) (*sdkProc, error) {
	abs, err := filepath.Abs(sdk)
	if err != nil {
		return nil, err
	}
	return startDriver(ctx, e, addr, []string{"node", filepath.Join("testenv", "e2b", "bench.mjs")},
		"E2B_SDK_DIR="+abs, "KVBOX_TEMPLATE="+tmpl)
}

// startDriver starts argv, an SDK's side of a section that answers a JSON
// line to each line it reads, pointed at kvbox serve on addr, with env
// added.
func startDriver(ctx context.Context, e *env, addr string, argv []string, env ...string) (*sdkProc, error) {
	key, err := exec.CommandContext(ctx, "bin/kvbox", "--state-dir", e.stateDir, "serve", "key").Output()
	if err != nil {
		return nil, fmt.Errorf("kvbox serve key: %w", err)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), "E2B_API_URL=http://"+addr, "E2B_SANDBOX_URL=http://"+addr,
		"E2B_API_KEY="+strings.TrimSpace(string(key)),
		"NO_PROXY=*", "HTTP_PROXY=", "HTTPS_PROXY=", "http_proxy=", "https_proxy=")
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &sdkProc{cmd: cmd, in: in, out: bufio.NewScanner(out)}, nil
}

func (p *sdkProc) stop() {
	p.in.Close()
	p.cmd.Wait()
}

// ask sends one command and decodes its answer into v.
func (p *sdkProc) ask(line string, v any) error {
	if _, err := fmt.Fprintln(p.in, line); err != nil {
		return err
	}
	if !p.out.Scan() {
		return fmt.Errorf("the SDK's bench ended: %v", p.out.Err())
	}
	var e struct{ Error string }
	json.Unmarshal(p.out.Bytes(), &e)
	if e.Error != "" {
		return fmt.Errorf("the SDK: %s", e.Error)
	}
	return json.Unmarshal(p.out.Bytes(), v)
}

type sdkOne struct{ create, first time.Duration }

func msDur(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }

func (p *sdkProc) one() (sdkOne, error) {
	var raw struct {
		Create float64 `json:"create_ms"`
		First  float64 `json:"first_ms"`
	}
	err := p.ask("one", &raw)
	return sdkOne{msDur(raw.Create), msDur(raw.First)}, err
}

type sdkMany struct {
	wall    time.Duration
	creates []time.Duration
}

func (p *sdkProc) many(n int) (sdkMany, error) {
	var raw struct {
		Wall   float64   `json:"wall_ms"`
		Create []float64 `json:"create_ms"`
	}
	if err := p.ask(fmt.Sprintf("many %d", n), &raw); err != nil {
		return sdkMany{}, err
	}
	m := sdkMany{wall: msDur(raw.Wall)}
	for _, c := range raw.Create {
		m.creates = append(m.creates, msDur(c))
	}
	return m, nil
}
