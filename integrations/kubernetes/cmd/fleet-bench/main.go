// Command fleet-bench measures kvbox on Kubernetes against kvbox on one
// host, in one run so that ratios hold on a noisy machine: a pod whose image
// is a pushed snapshot, from the client's create call to the client seeing
// it Running (a watch), alternated with `kvbox new --from` of the same
// snapshot in the same node's state dir; then a Deployment scaled 0 → N
// against `kvbox new --from --count N`. It prints medians, p90 and ratios
// as testenv/bench does.
//
// It brings up its own fleet: the local control plane of testenv/fleet.sh
// (up, in a state folder of its own) and one kvbox-node, kvbox-bench, with a
// state dir and bridge of its own on the node's podCIDR. The CLI's clones go
// into that state dir, on that bridge, from the very snapshot the node
// pulled into its cache, so both paths clone the same files on the same
// host. Everything it makes (pods, the Deployment, boxes, snapshots, the
// pushed manifest, the node, the control plane) is removed at the end, also
// when it is interrupted (SIGINT, SIGTERM, SIGHUP).
//
// Run it inside the test namespace, after make testenv (which builds the
// control plane): `make bench BENCH='-only fleet'`, or
//
//	cd integrations/kubernetes && ip netns exec kvbox-test go run ./cmd/fleet-bench
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"kvbox.dev/kvbox/base"
)

const testNetns = "kvbox-test"

type options struct {
	n          int    // pods (and CLI clones) timed one at a time
	replicas   int    // the Deployment's scale, and the CLI's --count
	image      string // the source box's image
	memory     string // the source box's RAM
	repo       string // the kvbox checkout: testenv/fleet.sh, bin/kvbox
	kvbox      string // the kvbox CLI
	kvboxNode  string // a kvbox-node binary; empty: built from this module
	sourceDir  string // the state dir the source box is made in
	nodeDir    string // the node's state dir (made, then removed)
	bridge     string // the node's bridge
	registry   string // the test registry
	fleetCache string // where testenv/fleet.sh build keeps the control plane
	keepLogs   bool
}

func main() {
	var o options
	flag.IntVar(&o.n, "n", 10, "pods created one at a time, and as many kvbox new --from, alternated")
	flag.IntVar(&o.replicas, "replicas", 10, "the Deployment scaled from 0 to this, against kvbox new --from --count this")
	flag.StringVar(&o.image, "image", "tiny", "image of the box the snapshot is made from (in -state-dir)")
	flag.StringVar(&o.memory, "memory", "256M", "RAM of the source box")
	flag.StringVar(&o.repo, "repo", "", "the kvbox checkout (testenv/fleet.sh, bin/kvbox); default: found above the working directory")
	flag.StringVar(&o.kvbox, "kvbox", "", "the kvbox CLI; default: REPO/bin/kvbox (make build)")
	flag.StringVar(&o.kvboxNode, "kvbox-node", "", "a kvbox-node binary; default: built from this module")
	flag.StringVar(&o.sourceDir, "state-dir", envOr("KVBOX_STATE_DIR", "/var/lib/kvbox"), "state dir holding -image, where the source box is made (KVBOX_STATE_DIR)")
	flag.StringVar(&o.nodeDir, "node-state-dir", "/var/lib/kvbox-fleet-bench", "the bench node's state dir: made by the bench, removed at its end; it must not exist")
	flag.StringVar(&o.bridge, "bridge", "kvfbench0", "the bench node's bridge")
	flag.StringVar(&o.registry, "registry", "127.0.0.1:5000", "the test registry (plain HTTP) the snapshot is pushed to")
	flag.StringVar(&o.fleetCache, "fleet-cache", envOr("KVBOX_FLEET_CACHE", "/var/lib/kvbox-testenv/k8s"), "the control plane testenv/fleet.sh build made (KVBOX_FLEET_CACHE)")
	flag.BoolVar(&o.keepLogs, "keep-logs", false, "keep the fleet's logs (the control plane's and kvbox-node's) after a run that succeeded")
	flag.Parse()
	if flag.NArg() > 0 {
		fatal(fmt.Errorf("unexpected argument %q (flags only; -h lists them)", flag.Arg(0)))
	}
	if o.n < 1 || o.replicas < 1 {
		fatal(fmt.Errorf("-n %d, -replicas %d: give at least 1 each", o.n, o.replicas))
	}
	if _, err := base.ParseSize(o.memory); err != nil {
		fatal(fmt.Errorf("-memory %q: %w", o.memory, err))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	if err := run(ctx, &o); err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("interrupted (%v); everything it made was removed", err)
		}
		fatal(err)
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "fleet-bench:", err)
	os.Exit(1)
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// say reports progress on stderr; the figures go to stdout.
func say(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[fleet-bench] "+format+"\n", args...)
}

// checkNetns refuses to run outside the test namespace: the control
// plane, the node and the boxes' addresses are that namespace's.
func checkNetns() error {
	out, _ := exec.Command("ip", "netns", "identify", strconv.Itoa(os.Getpid())).Output()
	if ns := strings.TrimSpace(string(out)); ns != testNetns {
		return fmt.Errorf("run inside the network namespace %s (ip netns exec %s ..., or make bench); this process is in %q", testNetns, testNetns, ns)
	}
	return nil
}

// findRepo is the nearest folder above dir holding testenv/fleet.sh.
func findRepo(dir string) (string, error) {
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "testenv", "fleet.sh")); err == nil {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("no kvbox checkout (testenv/fleet.sh) above %s: give -repo", dir)
		}
	}
}

// cleanups are run last in, first out, with a context of their own: they
// run after an interrupt too. Each reports what it could not remove.
type cleanups struct{ fs []func() error }

func (c *cleanups) add(f func() error) { c.fs = append(c.fs, f) }

func (c *cleanups) run() error {
	var errs []error
	for i := len(c.fs) - 1; i >= 0; i-- {
		if err := c.fs[i](); err != nil {
			say("cleanup: %v", err)
			errs = append(errs, err)
		}
	}
	c.fs = nil
	return errors.Join(errs...)
}

func run(ctx context.Context, o *options) (err error) {
	if os.Geteuid() != 0 {
		return errors.New("run as root: it starts libvirt guests and a control plane (make bench does)")
	}
	if err := checkNetns(); err != nil {
		return err
	}
	if o.repo == "" {
		wd, err := os.Getwd()
		if err != nil {
			return err
		}
		if o.repo, err = findRepo(wd); err != nil {
			return err
		}
	}
	if o.kvbox == "" {
		o.kvbox = filepath.Join(o.repo, "bin", "kvbox")
	}
	if _, err := os.Stat(o.kvbox); err != nil {
		return fmt.Errorf("the kvbox CLI: %w (make build makes bin/kvbox)", err)
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl"} {
		if _, err := os.Stat(filepath.Join(o.fleetCache, "v1.37.2", "bin", b)); err != nil {
			return fmt.Errorf("the control plane is not built (%v): run bash testenv/fleet.sh build (make testenv does)", err)
		}
	}
	if _, err := os.Stat(o.nodeDir); err == nil {
		return fmt.Errorf("the bench node's state dir %s exists (an earlier run's?): remove its boxes and snapshots and the folder, or give -node-state-dir", o.nodeDir)
	}

	start := time.Now()
	var cl cleanups
	defer func() {
		if cerr := cl.run(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("cleanup left something behind: %w", cerr))
		}
		say("done in %.0f s (cleanup included)", time.Since(start).Seconds())
	}()
	tmp, err := os.MkdirTemp("", "fleet-bench-")
	if err != nil {
		return err
	}
	cl.add(func() error {
		if err != nil || o.keepLogs {
			say("the fleet's logs are kept in %s/fleet/logs, kvbox-node's in %s", tmp, filepath.Join(tmp, "kvbox-node.log"))
			return nil
		}
		return os.RemoveAll(tmp)
	})

	f := &fleet{o: o, tmp: tmp, state: filepath.Join(tmp, "fleet")}
	if err := f.up(ctx, &cl); err != nil {
		return err
	}
	return bench(ctx, f, &cl)
}
