package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/step"
)

// debianClones is how many clones of the Debian snapshot are timed.
const debianClones = 3

// benchDebian times warm clones at the issues' real size: the Debian
// image, 4 GiB RAM, about 1.5 GB touched (1.2 GB written to /dev/shm),
// at 2 vCPUs and at 1, step by step, and their rm, against the peer
// `virsh restore` of a saved clone of the same snapshot, in the same run.
func benchDebian(ctx context.Context, e *env) error {
	im, err := (image.Store{Dir: e.stateDir + "/images"}).Get("debian")
	if err != nil {
		return fmt.Errorf("the Debian image: %w (make testenv builds it)", err)
	}
	two, err := debianSeries(ctx, e, im, 2, "bench-deb-warm")
	if err != nil {
		return err
	}
	peer, err := debianPeer(ctx, e, two.snap)
	if err != nil {
		return err
	}
	cold, err := coldClone(ctx, e, two.snap)
	if err != nil {
		return err
	}
	one, err := debianSeries(ctx, e, im, 1, "bench-deb-warm-1cpu")
	if err != nil {
		return err
	}
	for _, r := range []debianRun{two, one} {
		fmt.Printf("Debian, 4 GiB RAM, %d vCPU, ~1.5 GB touched: cold boot %.1f s, snapshot %s on disk, paused %.0f ms\n",
			r.cpus, r.boot.Seconds(), base.FormatSize(r.snap.SizeBytes), ms(r.pause))
		fmt.Printf("warm clone to ready (median of %d)       %8.0f ms\n", len(r.walls), ms(median(r.walls)))
		for _, name := range r.timings[0].Names() {
			var ds []time.Duration
			for _, t := range r.timings {
				ds = append(ds, t.Get(name))
			}
			fmt.Printf("  %-38s %8.0f ms\n", name, ms(median(ds)))
		}
		fmt.Printf("rm --force of a running clone (median of %d) %5.0f ms\n", len(r.removes), ms(median(r.removes)))
	}
	clone := median(two.walls)
	fmt.Printf("peer virsh restore of a saved 2-vCPU clone %6.0f ms   (median of %d; save file %s, in page cache, as the snapshot's files are for the clones above)\n",
		ms(peer.warm), peerRuns, base.FormatSize(peer.size))
	fmt.Printf("ratio virsh restore / kvbox warm clone (2 vCPU): %.1fx\n", float64(peer.warm)/float64(clone))
	fmt.Printf("from disk (medians of %d): virsh restore --bypass-cache %.0f ms; kvbox warm clone, the snapshot's files dropped from page cache first: %.0f ms; ratio %.1fx\n",
		peerRuns, ms(peer.cold), ms(cold), float64(peer.cold)/float64(cold))
	// The same snapshot through the registry: its 1.4 GB of touched RAM,
	// not its 4 GiB, on the wire.
	return registryTimes(ctx, e, two.snap)
}

// debianSpec is a box of the Debian image im at the real size:
// 4 GiB RAM, cpus vCPUs, an 8 GiB disk.
func debianSpec(im image.Image, name string, cpus int) kvbox.CreateRequest {
	return kvbox.CreateRequest{Name: name, Image: im.Name, CPUs: cpus, MemoryBytes: 4 << 30,
		DiskBytes: max(8<<30, im.VirtualSize), AgentTimeout: 3 * time.Minute}
}

// debianRun is one Debian source's snapshot and its timed clones.
type debianRun struct {
	cpus           int
	boot, pause    time.Duration
	snap           snapshot.Snapshot
	walls, removes []time.Duration
	timings        []step.Timings
}

// debianSeries boots a Debian source with cpus vCPUs, touches ~1.5 GB of
// its RAM, snapshots it as name, and times debianClones clones of it and
// their rm. The source goes when the series is done.
func debianSeries(ctx context.Context, e *env, im image.Image, cpus int, name string) (debianRun, error) {
	r := debianRun{cpus: cpus}
	src := fmt.Sprintf("bench-deb-src-%d", cpus)
	t0 := time.Now()
	if _, err := e.create(ctx, debianSpec(im, src, cpus)); err != nil {
		return r, err
	}
	r.boot = time.Since(t0)
	defer e.k.Remove(context.Background(), src, true)
	if _, err := e.kvboxCLI(ctx, "exec", src, "--", "sh", "-c", "yes kvbox-bench-touched-page | head -c 1200M > /dev/shm/fill && sync"); err != nil {
		return r, err
	}
	res, err := e.snapshot(ctx, src, name)
	if err != nil {
		return r, err
	}
	e.cleanup = append(e.cleanup, func() { e.k.RemoveSnapshot(context.Background(), name) })
	r.snap, r.pause = res.Snapshot, res.Pause
	for i := range debianClones {
		clone := fmt.Sprintf("bench-deb-clone-%d-%d", cpus, i)
		t0 := time.Now()
		_, tm, err := e.clone(ctx, r.snap, clone)
		if err != nil {
			return r, err
		}
		r.walls, r.timings = append(r.walls, time.Since(t0)), append(r.timings, tm)
		t0 = time.Now()
		if err := e.k.Remove(ctx, clone, true); err != nil {
			return r, err
		}
		r.removes = append(r.removes, time.Since(t0))
	}
	return r, nil
}

// peerRestore is virsh restore of a saved clone, median of peerRuns
// each: with the save file in page cache (warm), and read past it (cold,
// --bypass-cache). How long a restore takes depends much on the host's
// free memory (the first after a save took 1.7 s on a host whose page
// cache had just been dropped, 5.5 s on a fuller one), so each is timed
// more than once, alternated.
type peerRestore struct {
	warm, cold time.Duration
	size       int64
}

const peerRuns = 3

// debianPeer saves a clone of snap with virsh and times virsh restore of
// it, warm and cold.
func debianPeer(ctx context.Context, e *env, snap snapshot.Snapshot) (peerRestore, error) {
	var r peerRestore
	peer := "bench-deb-peer"
	if _, _, err := e.clone(ctx, snap, peer); err != nil {
		return r, err
	}
	e.cleanup = append(e.cleanup, func() { e.k.Remove(context.Background(), peer, true) })
	sav := filepath.Join(e.stateDir, "bench-deb.sav")
	defer os.Remove(sav)
	if out, err := virsh(ctx, "save", peer, sav); err != nil {
		return r, fmt.Errorf("virsh save: %v: %s", err, out)
	}
	if fi, err := os.Stat(sav); err == nil {
		r.size = fi.Size()
	}
	var warm, cold []time.Duration
	for i := range 2 * peerRuns {
		args, into := []string{"restore", sav}, &warm
		if i%2 == 1 {
			args, into = []string{"restore", "--bypass-cache", sav}, &cold
		}
		t0 := time.Now()
		if out, err := virsh(ctx, args...); err != nil {
			return r, fmt.Errorf("virsh %s: %v: %s", strings.Join(args, " "), err, out)
		}
		*into = append(*into, time.Since(t0))
		if out, err := virsh(ctx, "destroy", peer); err != nil {
			return r, fmt.Errorf("virsh destroy: %v: %s", err, out)
		}
	}
	r.warm, r.cold = median(warm), median(cold)
	return r, nil
}

// coldClone times peerRuns clones of snap, each after the snapshot's
// files were dropped from the page cache (POSIX_FADV_DONTNEED), against
// virsh restore --bypass-cache; the median.
func coldClone(ctx context.Context, e *env, snap snapshot.Snapshot) (time.Duration, error) {
	ents, err := os.ReadDir(snap.Dir)
	if err != nil {
		return 0, err
	}
	var walls []time.Duration
	for i := range peerRuns {
		for _, ent := range ents {
			f, err := os.Open(snap.Path(ent.Name()))
			if err != nil {
				return 0, err
			}
			err = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
			f.Close()
			if err != nil {
				return 0, err
			}
		}
		name := fmt.Sprintf("bench-deb-cold-%d", i)
		t0 := time.Now()
		if _, _, err := e.clone(ctx, snap, name); err != nil {
			return 0, err
		}
		walls = append(walls, time.Since(t0))
		if err := e.k.Remove(ctx, name, true); err != nil {
			return 0, err
		}
	}
	return median(walls), nil
}
