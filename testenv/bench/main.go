// Command bench measures kvbox on this host, in one run so that ratios hold
// on a noisy machine: each section times kvbox and the peers it is compared
// with (virsh, tar) side by side and prints medians and ratios. Run it with
// `make bench` (inside the kvbox-test namespace, after make testenv), or
// `make bench BENCH='-only clone,registry'` for some sections. It creates
// boxes and snapshots named bench-* and removes them.
package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/step"
	"kvbox.dev/kvbox/testenv/benchstat"
)

// env is what every section gets: the host, the image to boot and the
// sizes asked for on the command line.
type env struct {
	k *kvbox.Host // what kvbox's commands call: every kvbox operation timed goes through it
	// peer is k's libvirt side, for the peers alone (virsh's files given
	// to QEMU, the agent of a box virsh started again): none of kvbox's.
	peer     *domain.Host
	stateDir string
	im       image.Image
	memBytes int64
	n        int // clones and snapshots to time
	boots    int // cold boots to time

	warm      *snapshot.Snapshot // made by warmSnapshot, once
	warmPause time.Duration
	cleanup   []func() // run in reverse when the bench ends
}

// spec is a box of the bench image with the bench's RAM and cpus vCPUs.
func (e *env) spec(name string, cpus int) kvbox.CreateRequest {
	return kvbox.CreateRequest{Name: name, Image: e.im.Name, CPUs: cpus, MemoryBytes: e.memBytes,
		DiskBytes: max(1<<30, e.im.VirtualSize), AgentTimeout: 2 * time.Minute}
}

// create boots a box as kvbox new does.
func (e *env) create(ctx context.Context, req kvbox.CreateRequest) (kvbox.Box, error) {
	b, _, err := e.k.Create(ctx, req)
	return b, err
}

// snapshot takes snapshot name of box as kvbox snapshots new does.
func (e *env) snapshot(ctx context.Context, box, name string) (snapshot.Result, error) {
	return e.k.Snapshot(ctx, box, name, kvbox.SnapshotOptions{})
}

// clone starts warm clone name of snap as kvbox new --from does.
func (e *env) clone(ctx context.Context, snap snapshot.Snapshot, name string) (kvbox.Box, step.Timings, error) {
	return e.k.Clone(ctx, kvbox.CloneRequest{Snapshot: snap.Name, Name: name, AgentTimeout: 2 * time.Minute})
}

// section is one part of the bench. Sections run in this order; each
// creates and removes its own boxes.
type section struct {
	name string
	run  func(context.Context, *env) error
}

var sections = []section{
	{"clone", benchClone},
	{"cycle", benchCycle},
	{"registry", benchRegistry},
	{"snapshot", benchSnapshot},
	{"ports", benchPorts},
	{"debian", benchDebian},
	{"snapshot-debian", benchSnapshotDebian},
	{"cp", benchCp},
	{"lifecycle", benchLifecycle},
	{"serve", benchServe},
	{"egress", benchEgress},
	{"codeinterp", benchCodeInterp},
}

func main() {
	imageName := flag.String("image", "tiny", "image to boot")
	n := flag.Int("n", 10, "clones (and snapshots) to time")
	boots := flag.Int("boots", 3, "cold boots to time")
	mem := flag.String("memory", "256M", "RAM of the source box")
	stateDir := flag.String("state-dir", envOr("KVBOX_STATE_DIR", "/var/lib/kvbox"), "kvbox state directory (KVBOX_STATE_DIR)")
	only := flag.String("only", "", "comma-separated sections to run (default all): "+sectionNames())
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *imageName, *mem, *stateDir, *n, *boots, *only); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func sectionNames() string {
	var s []string
	for _, sec := range sections {
		s = append(s, sec.name)
	}
	return strings.Join(s, ",")
}

func run(ctx context.Context, imageName, memSize, stateDir string, n, boots int, only string) error {
	want := map[string]bool{}
	for _, s := range strings.Split(only, ",") {
		if s = strings.TrimSpace(s); s != "" {
			want[s] = true
		}
	}
	for s := range want {
		if !strings.Contains(","+sectionNames()+",", ","+s+",") {
			return fmt.Errorf("no section %q (sections: %s)", s, sectionNames())
		}
	}
	// The bridge and subnet kvbox's own commands read, so that a bench
	// run beside other kvbox users keeps to its own network.
	nc, err := network.Parse(envOr("KVBOX_BRIDGE", network.Default.Bridge), envOr("KVBOX_SUBNET", network.Default.Subnet.String()))
	if err != nil {
		return err
	}
	// The library's host, as kvbox's commands open it: the bench removes
	// boxes the way kvbox rm does.
	k, err := kvbox.Open(ctx, kvbox.Config{StateDir: stateDir, Network: nc, Notify: func(n kvbox.Notice) {
		fmt.Fprintln(os.Stderr, "bench: kvbox:", n.Text)
	}})
	if err != nil {
		return err
	}
	defer k.Close()
	e := &env{k: k, peer: k.Domain(), stateDir: stateDir, n: n, boots: boots}
	if e.im, err = (image.Store{Dir: stateDir + "/images"}).Get(imageName); err != nil {
		return err
	}
	if e.memBytes, err = base.ParseSize(memSize); err != nil {
		return err
	}
	defer func() {
		for i := len(e.cleanup) - 1; i >= 0; i-- {
			e.cleanup[i]()
		}
	}()
	hc, err := k.HostCompat(ctx)
	if err != nil {
		return err
	}
	typ := hc.DomainType
	fmt.Printf("kvbox bench: image %s, %s RAM, domain type %s, %d boots, %d snapshots, %d clones\n", imageName, memSize, typ, boots, n, n)
	for _, sec := range sections {
		if len(want) > 0 && !want[sec.name] {
			continue
		}
		fmt.Printf("\n== %s\n", sec.name)
		t0 := time.Now()
		if err := sec.run(ctx, e); err != nil {
			return fmt.Errorf("%s: %w", sec.name, err)
		}
		fmt.Printf("(section %s took %.1f s)\n", sec.name, time.Since(t0).Seconds())
		if !saidReaper {
			saidReaper = sayReaper()
		}
	}
	return nil
}

// saidReaper is set once the bench said what reaps QEMU.
var saidReaper bool

// sayReaper prints which process reaps a box's QEMU, if one runs: its
// parent, the nearest child subreaper above libvirtd or else PID 1. libvirt's
// destroy and kvbox rm wait until the QEMU they killed is reaped, so the rm
// and job-cycle figures hold for a host whose reaper is as quick as this one
// (a host's systemd reaps at once; this test machine's PID 1 did not, which
// is why testenv/libvirtd.sh runs libvirtd under tini -s).
func sayReaper() bool {
	ds, _ := os.ReadDir("/proc")
	for _, d := range ds {
		comm, err := os.ReadFile("/proc/" + d.Name() + "/comm")
		if err != nil || !strings.HasPrefix(string(comm), "qemu-system") {
			continue
		}
		ppid := procField(d.Name(), "PPid")
		parent, _ := os.ReadFile("/proc/" + ppid + "/comm")
		fmt.Printf("QEMU (pid %s) is reaped by its parent %s (pid %s)\n", d.Name(), strings.TrimSpace(string(parent)), ppid)
		return true
	}
	return false
}

// procField is a field of /proc/PID/status.
func procField(pid, name string) string {
	b, _ := os.ReadFile("/proc/" + pid + "/status")
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

func median[T cmp.Ordered](xs []T) T {
	if len(xs) == 0 {
		var zero T
		return zero
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// The timings' summaries, shared with the other bench.
var pct, ms = benchstat.Pct, benchstat.Ms
