package main

import (
	"context"
	"fmt"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/step"
)

// warmSnapshot is a snapshot of a running source box of the bench image,
// made once and shared by the sections that need one (clone, registry).
// The box and snapshot are removed when the bench ends.
func (e *env) warmSnapshot(ctx context.Context) (snapshot.Snapshot, error) {
	if e.warm != nil {
		return *e.warm, nil
	}
	src := "bench-src"
	if _, err := e.create(ctx, e.spec(src, 1)); err != nil {
		return snapshot.Snapshot{}, err
	}
	e.cleanup = append(e.cleanup, func() { e.k.Remove(context.Background(), src, true) })
	name := "bench-warm"
	res, err := e.snapshot(ctx, src, name)
	if err != nil {
		return snapshot.Snapshot{}, err
	}
	e.cleanup = append(e.cleanup, func() { e.k.RemoveSnapshot(context.Background(), name) })
	e.warmPause = res.Pause
	e.warm = &res.Snapshot
	return res.Snapshot, nil
}

// benchClone times cold boots to agent-ready, then warm clones of one
// snapshot step by step, and `rm --force` of each clone.
func benchClone(ctx context.Context, e *env) error {
	var boot []time.Duration
	for i := range e.boots {
		name := fmt.Sprintf("bench-boot-%d", i)
		t0 := time.Now()
		if _, err := e.create(ctx, e.spec(name, 1)); err != nil {
			return err
		}
		boot = append(boot, time.Since(t0))
		if err := e.k.Remove(ctx, name, true); err != nil {
			return err
		}
	}
	snap, err := e.warmSnapshot(ctx)
	if err != nil {
		return err
	}
	walls, timings, removes, err := cloneSeries(ctx, e, snap, "bench-clone")
	if err != nil {
		return err
	}
	total := median(walls)
	fmt.Printf("cold boot to agent-ready (median of %d)   %8.0f ms\n", e.boots, ms(median(boot)))
	fmt.Printf("snapshot pause (source box)              %8.0f ms   (snapshot size %s)\n", ms(e.warmPause), base.FormatSize(snap.SizeBytes))
	fmt.Printf("warm clone to ready, 1 vCPU (median of %d) %6.0f ms\n", e.n, ms(total))
	// The clone's own steps (snapshot.Clone's plan), by name.
	for _, name := range timings[0].Names() {
		var ds []time.Duration
		for _, t := range timings {
			ds = append(ds, t.Get(name))
		}
		fmt.Printf("  %-38s %8.0f ms\n", name, ms(median(ds)))
	}
	m := median(removes)
	fmt.Printf("rm --force of a running clone (median of %d) %5.0f ms   (clone + rm %0.f ms; rm/clone %.2f)\n",
		len(removes), ms(m), ms(total+m), float64(m)/float64(total))
	fmt.Printf("ratio warm clone / cold boot: %.3f\n", float64(total)/float64(median(boot)))
	return benchClone2(ctx, e)
}

// cloneSeries makes e.n warm clones of snap one after the other, each
// removed (rm --force) before the next, and returns their times.
func cloneSeries(ctx context.Context, e *env, snap snapshot.Snapshot, prefix string) (walls []time.Duration, timings []step.Timings, removes []time.Duration, err error) {
	for i := range e.n {
		name := fmt.Sprintf("%s-%d", prefix, i)
		t0 := time.Now()
		_, tm, err := e.clone(ctx, snap, name)
		if err != nil {
			return nil, nil, nil, err
		}
		walls = append(walls, time.Since(t0))
		timings = append(timings, tm)
		t0 = time.Now()
		if err := e.k.Remove(ctx, name, true); err != nil {
			return nil, nil, nil, err
		}
		removes = append(removes, time.Since(t0))
	}
	return walls, timings, removes, nil
}

// benchClone2 is the warm clone of a 2-vCPU source box of the bench image
// (the series above is of a 1-vCPU one): two vCPUs share the guest's cold
// code, on this machine's two cores.
func benchClone2(ctx context.Context, e *env) error {
	src, name := "bench-src2", "bench-warm2"
	if _, err := e.create(ctx, e.spec(src, 2)); err != nil {
		return err
	}
	defer e.k.Remove(context.Background(), src, true)
	res, err := e.snapshot(ctx, src, name)
	if err != nil {
		return err
	}
	defer e.k.RemoveSnapshot(context.Background(), name)
	walls, timings, _, err := cloneSeries(ctx, e, res.Snapshot, "bench-clone2")
	if err != nil {
		return err
	}
	stepMedian := func(step string) float64 {
		var ds []time.Duration
		for _, t := range timings {
			ds = append(ds, t.Get(step))
		}
		return ms(median(ds))
	}
	fmt.Printf("warm clone to ready, 2 vCPU (median of %d) %6.0f ms   (start %.0f ms, identify %.0f ms)\n",
		e.n, ms(median(walls)), stepMedian("start"), stepMedian("identify"))
	return nil
}
