package main

import (
	"context"
	"fmt"
	"time"

	"kvbox.dev/kvbox/domain"
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
	if _, err := e.h.Create(ctx, e.spec(src, 1)); err != nil {
		return snapshot.Snapshot{}, err
	}
	e.cleanup = append(e.cleanup, func() { e.h.Remove(context.Background(), src, true) })
	st := snapshot.Store{Dir: e.stateDir + "/snapshots"}
	name := "bench-warm"
	res, err := snapshot.Create(ctx, e.h, st, src, name)
	if err != nil {
		return snapshot.Snapshot{}, err
	}
	e.cleanup = append(e.cleanup, func() { snapshot.Remove(e.h, st, name) })
	e.warmPause = res.Pause
	snap, err := st.Get(name)
	if err != nil {
		return snapshot.Snapshot{}, err
	}
	e.warm = &snap
	return snap, nil
}

// benchClone times cold boots to agent-ready, then warm clones of one
// snapshot step by step, and `rm --force` of each clone.
func benchClone(ctx context.Context, e *env) error {
	var boot []time.Duration
	for i := range e.boots {
		name := fmt.Sprintf("bench-boot-%d", i)
		t0 := time.Now()
		if _, err := e.h.Create(ctx, e.spec(name, 1)); err != nil {
			return err
		}
		boot = append(boot, time.Since(t0))
		if err := e.h.Remove(ctx, name, true); err != nil {
			return err
		}
	}
	snap, err := e.warmSnapshot(ctx)
	if err != nil {
		return err
	}
	var timings []step.Timings
	var walls, removes []time.Duration
	for i := range e.n {
		name := fmt.Sprintf("bench-clone-%d", i)
		t0 := time.Now()
		_, tm, err := snapshot.Clone(ctx, e.h, snap, name, 2*time.Minute)
		if err != nil {
			return err
		}
		walls = append(walls, time.Since(t0))
		timings = append(timings, tm)
		t0 = time.Now()
		if err := e.h.Remove(ctx, name, true); err != nil {
			return err
		}
		removes = append(removes, time.Since(t0))
	}
	total := median(walls)
	fmt.Printf("cold boot to agent-ready (median of %d)   %8.0f ms\n", e.boots, ms(median(boot)))
	fmt.Printf("snapshot pause (source box)              %8.0f ms   (snapshot size %s)\n", ms(e.warmPause), domain.FormatSize(snap.SizeBytes))
	fmt.Printf("warm clone to ready (median of %d)       %8.0f ms\n", e.n, ms(total))
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
	return nil
}
