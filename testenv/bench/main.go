// Command bench measures kvbox on this host, in one run so that ratios hold
// on a noisy machine: a cold boot to agent-ready, a snapshot's pause, and a
// warm clone to ready, each step of it. Run it with `make bench` (inside the
// kvbox-test namespace, after make testenv). It creates boxes named bench-*
// and removes them.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"time"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/templates"
)

func main() {
	imageName := flag.String("image", "tiny", "image to boot")
	n := flag.Int("n", 10, "clones (and snapshots) to time")
	boots := flag.Int("boots", 3, "cold boots to time")
	mem := flag.String("memory", "256M", "RAM of the source box")
	stateDir := flag.String("state-dir", "/var/lib/kvbox", "kvbox state directory")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *imageName, *mem, *stateDir, *n, *boots); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, imageName, memSize, stateDir string, n, boots int) error {
	conn, err := domain.Connect(domain.DefaultURI())
	if err != nil {
		return err
	}
	defer conn.Close()
	h := &domain.Host{Conn: conn, URI: domain.DefaultURI(), StateDir: stateDir, Net: network.Default, Template: templates.Box}
	im, err := image.Store{Dir: stateDir + "/images"}.Get(imageName)
	if err != nil {
		return err
	}
	memBytes, err := domain.ParseSize(memSize)
	if err != nil {
		return err
	}
	typ, _ := h.DomainType()
	fmt.Printf("kvbox bench: image %s, %s RAM, 1 vCPU, domain type %s, %d boots, %d snapshots, %d clones\n\n", imageName, memSize, typ, boots, n, n)
	spec := func(name string) domain.Spec {
		return domain.Spec{Name: name, CPUs: 1, MemoryBytes: memBytes, DiskBytes: max(1<<30, im.VirtualSize), AgentTimeout: 2 * time.Minute,
			Boot: domain.Boot{Image: im.Name, Disk: im.Disk, DiskFormat: im.Format, VirtualSize: im.VirtualSize, Kernel: im.Kernel, Initrd: im.Initrd, Cmdline: im.Cmdline}}
	}

	var boot []time.Duration
	for i := range boots {
		name := fmt.Sprintf("bench-boot-%d", i)
		t0 := time.Now()
		if _, err := h.Create(ctx, spec(name)); err != nil {
			return err
		}
		boot = append(boot, time.Since(t0))
		if err := h.Remove(ctx, name, true); err != nil {
			return err
		}
	}

	src := "bench-src"
	if _, err := h.Create(ctx, spec(src)); err != nil {
		return err
	}
	defer h.Remove(context.Background(), src, true)
	st := snapshot.Store{Dir: stateDir + "/snapshots"}
	var pauses []time.Duration
	var snapName string
	for i := range n {
		snapName = fmt.Sprintf("bench-snap-%d", i)
		res, err := snapshot.Create(ctx, h, st, src, snapName)
		if err != nil {
			return err
		}
		pauses = append(pauses, res.Pause)
		if i < n-1 {
			if err := snapshot.Remove(h, st, snapName); err != nil {
				return err
			}
		}
	}
	defer snapshot.Remove(h, st, snapName)
	snap, err := st.Get(snapName)
	if err != nil {
		return err
	}

	var timings []snapshot.CloneTiming
	for i := range n {
		name := fmt.Sprintf("bench-clone-%d", i)
		_, tm, err := snapshot.Clone(ctx, h, snap, name, 2*time.Minute)
		if err != nil {
			return err
		}
		timings = append(timings, tm)
		if err := timedRemove(ctx, h, name); err != nil {
			return err
		}
	}

	pick := func(f func(snapshot.CloneTiming) time.Duration) time.Duration {
		var ds []time.Duration
		for _, t := range timings {
			ds = append(ds, f(t))
		}
		return median(ds)
	}
	fmt.Printf("cold boot to agent-ready (median of %d)   %8.0f ms\n", boots, ms(median(boot)))
	fmt.Printf("snapshot pause (median of %d)            %8.0f ms   (snapshot size %s)\n", n, ms(median(pauses)), domain.FormatSize(snap.SizeBytes))
	fmt.Printf("warm clone to ready (median of %d)       %8.0f ms\n", n, ms(pick(func(t snapshot.CloneTiming) time.Duration { return t.Total })))
	for _, s := range []struct {
		name string
		f    func(snapshot.CloneTiming) time.Duration
	}{
		{"define", func(t snapshot.CloneTiming) time.Duration { return t.Define }},
		{"libvirt start (paused)", func(t snapshot.CloneTiming) time.Duration { return t.Start }},
		{"close port", func(t snapshot.CloneTiming) time.Duration { return t.ClosePort }},
		{"load state", func(t snapshot.CloneTiming) time.Duration { return t.Load }},
		{"resume", func(t snapshot.CloneTiming) time.Duration { return t.Resume }},
		{"agent answers", func(t snapshot.CloneTiming) time.Duration { return t.Agent }},
		{"re-identify", func(t snapshot.CloneTiming) time.Duration { return t.Reidentify }},
		{"open port", func(t snapshot.CloneTiming) time.Duration { return t.OpenPort }},
		{"persist", func(t snapshot.CloneTiming) time.Duration { return t.Persist }},
	} {
		fmt.Printf("  %-38s %8.0f ms\n", s.name, ms(pick(s.f)))
	}
	printRemoves(pick(func(t snapshot.CloneTiming) time.Duration { return t.Total }))
	fmt.Printf("\nratio warm clone / cold boot: %.3f\n", float64(pick(func(t snapshot.CloneTiming) time.Duration { return t.Total }))/float64(median(boot)))
	return benchRegistry(ctx, conn, stateDir, snap)
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
