package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"kvbox.dev/kvbox/image"
)

// The code-interpreter SDKs the codeinterp section drives, as set-up
// installs them (testenv/e2b/code-interpreter-V; the venv
// code-interpreter-V of testenv/e2b-py-code-interpreter/V).
const (
	codeInterpJS = "code-interpreter-2.8.0"
	codeInterpPy = "code-interpreter-2.11.5"
)

// codeInterpTrivial is how many trivial cells (and commands) are timed in
// one sandbox, per SDK.
const codeInterpTrivial = 20

// benchCodeInterp times E2B's code interpreter through its JS SDK against
// kvbox serve: Sandbox.create, then a first runCode that uses pandas, on a
// warm template (its kernel up with the data stack imported before the
// snapshot) against a cold one (the same image, its server started with
// KVBOX_CODEINTERP_WARM=0: the first call starts the kernel and the
// imports), alternated; then a trivial cell's round trip in a running
// sandbox, through the JS SDK and the Python SDK, each against the same
// SDK's commands.run('true') in the same sandbox.
func benchCodeInterp(ctx context.Context, e *env) error {
	im, err := (image.Store{Dir: e.stateDir + "/images"}).Get(image.CodeInterpreterImage)
	if err != nil {
		return fmt.Errorf("the code-interpreter image: %w (kvbox images build code-interpreter)", err)
	}
	js := filepath.Join("testenv", "e2b", codeInterpJS)
	if _, err := os.Stat(filepath.Join(js, "node_modules", "@e2b", "code-interpreter")); err != nil {
		return fmt.Errorf("the code interpreter's JS SDK: %w (make testenv installs it)", err)
	}
	py := filepath.Join(envOr("KVBOX_TESTENV_CACHE", "/var/cache/kvbox-testenv"), "e2b-py", codeInterpPy, "bin", "python")
	if _, err := os.Stat(py); err != nil {
		return fmt.Errorf("the code interpreter's Python SDK: %w (make testenv installs it)", err)
	}
	warm, err := codeInterpTemplate(ctx, e, im.Name, "bench-ci-warm", true)
	if err != nil {
		return err
	}
	cold, err := codeInterpTemplate(ctx, e, im.Name, "bench-ci-cold", false)
	if err != nil {
		return err
	}
	srv, addr, err := startServe(ctx, e)
	if err != nil {
		return err
	}
	defer srv.stop()
	abs, err := filepath.Abs(js)
	if err != nil {
		return err
	}
	node, err := startDriver(ctx, e, addr, []string{"node", filepath.Join("testenv", "e2b", "codeinterp-bench.mjs")}, "E2B_SDK_DIR="+abs)
	if err != nil {
		return err
	}
	defer node.stop()
	pyd, err := startDriver(ctx, e, addr, []string{py, "-I", filepath.Join("testenv", "e2b-py-code-interpreter", "bench.py")})
	if err != nil {
		return err
	}
	defer pyd.stop()

	// A first of each, not counted (page cache, the SDK's connections).
	var r ciFirst
	for _, t := range []string{warm, cold} {
		if err := node.ask("first "+t, &r); err != nil {
			return err
		}
	}
	var wCreate, wFirst, cCreate, cFirst []time.Duration
	for range e.n {
		if err := node.ask("first "+warm, &r); err != nil {
			return err
		}
		wCreate, wFirst = append(wCreate, msDur(r.Create)), append(wFirst, msDur(r.First))
		if err := node.ask("first "+cold, &r); err != nil {
			return err
		}
		cCreate, cFirst = append(cCreate, msDur(r.Create)), append(cFirst, msDur(r.First))
	}
	var jsT, pyT ciTrivial
	if err := node.ask(fmt.Sprintf("trivial %s %d", warm, codeInterpTrivial), &jsT); err != nil {
		return err
	}
	if err := pyd.ask(fmt.Sprintf("trivial %s %d", warm, codeInterpTrivial), &pyT); err != nil {
		return err
	}

	row := func(what string, ds []time.Duration) {
		fmt.Printf("  %-58s %7.0f ms %7.0f ms\n", what, ms(pct(ds, 50)), ms(pct(ds, 90)))
	}
	fmt.Printf("code-interpreter image (%s), 2 vCPU, 1 GiB; %d of each, warm and cold alternated; @e2b/code-interpreter %s over kvbox serve\n",
		im.Name, e.n, strings.TrimPrefix(codeInterpJS, "code-interpreter-"))
	fmt.Printf("first cell: a pandas DataFrame of 1000 rows and its describe()\n")
	fmt.Printf("  %-58s %10s %10s\n", "", "p50", "p90")
	row("warm template: Sandbox.create", wCreate)
	row("warm template: create to the first runCode's end", wFirst)
	row("cold template (kernel on demand): Sandbox.create", cCreate)
	row("cold template: create to the first runCode's end", cFirst)
	fmt.Printf("ratio cold / warm, create to first runCode (p50): %.1fx; the first cell alone (p50): warm %.0f ms, cold %.0f ms\n",
		float64(pct(cFirst, 50))/float64(pct(wFirst, 50)), ms(pct(wFirst, 50)-pct(wCreate, 50)), ms(pct(cFirst, 50)-pct(cCreate, 50)))
	fmt.Printf("a trivial cell in a running sandbox, %d each, alternated with the same SDK's commands.run('true') (the peer: envd's round trip)\n", codeInterpTrivial)
	fmt.Printf("  %-58s %10s %10s\n", "", "p50", "p90")
	row("JS runCode('1')", jsT.cells())
	row("JS commands.run('true')", jsT.commands())
	row("Python run_code('1') (e2b-code-interpreter 2.11.5, sync)", pyT.cells())
	row("Python commands.run('true')", pyT.commands())
	return nil
}

type ciFirst struct {
	Create float64 `json:"create_ms"`
	First  float64 `json:"first_ms"`
}

type ciTrivial struct {
	Cell    []float64 `json:"cell_ms"`
	Command []float64 `json:"command_ms"`
}

func durs(fs []float64) []time.Duration {
	var ds []time.Duration
	for _, f := range fs {
		ds = append(ds, msDur(f))
	}
	return ds
}

func (t ciTrivial) cells() []time.Duration    { return durs(t.Cell) }
func (t ciTrivial) commands() []time.Duration { return durs(t.Command) }

// codeInterpTemplate makes snapshot name of a box of the code-interpreter
// image img: once its server answers health with its Python kernel up and
// the data stack imported (warm), or with its server started again with
// KVBOX_CODEINTERP_WARM=0 and no kernel running (cold). The box goes, the
// snapshot when the bench ends.
func codeInterpTemplate(ctx context.Context, e *env, img, name string, warm bool) (string, error) {
	src := name + "-src"
	if _, err := e.kvboxCLI(ctx, "new", "--image", img, "--cpus", "2", "--memory", "1G", "--timeout", "600s", src); err != nil {
		return "", err
	}
	defer e.kvboxCLI(context.Background(), "rm", "--force", src)
	ready := "for i in $(seq 1500); do [ \"$(curl -sf http://127.0.0.1:49999/health)\" = '\"OK\"' ] && break; sleep 0.4; done; " +
		"[ \"$(curl -sf http://127.0.0.1:49999/health)\" = '\"OK\"' ]"
	script := ready
	if !warm {
		script = ready + " && mkdir -p /etc/systemd/system/kvbox-codeinterp.service.d && " +
			"printf '[Service]\\nEnvironment=KVBOX_CODEINTERP_WARM=0\\n' > /etc/systemd/system/kvbox-codeinterp.service.d/cold.conf && " +
			"systemctl daemon-reload && systemctl restart kvbox-codeinterp && " + ready +
			" && [ \"$(curl -sf http://127.0.0.1:49999/contexts)\" = '[]' ] && ! pgrep -f 'ipykernel[_]launcher'"
	}
	if _, err := e.kvboxCLI(ctx, "exec", src, "--", "sh", "-c", script); err != nil {
		return "", err
	}
	if _, err := e.kvboxCLI(ctx, "snapshots", "new", src, name); err != nil {
		return "", err
	}
	e.cleanup = append(e.cleanup, func() { e.k.RemoveSnapshot(context.Background(), name) })
	return name, nil
}
