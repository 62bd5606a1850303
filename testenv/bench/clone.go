package main

import (
	"context"
	"fmt"
	"time"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
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
	var timings []snapshot.CloneTiming
	var removes []time.Duration
	for i := range e.n {
		name := fmt.Sprintf("bench-clone-%d", i)
		_, tm, err := snapshot.Clone(ctx, e.h, snap, name, 2*time.Minute)
		if err != nil {
			return err
		}
		timings = append(timings, tm)
		t0 := time.Now()
		if err := e.h.Remove(ctx, name, true); err != nil {
			return err
		}
		removes = append(removes, time.Since(t0))
	}
	pick := func(f func(snapshot.CloneTiming) time.Duration) time.Duration {
		var ds []time.Duration
		for _, t := range timings {
			ds = append(ds, f(t))
		}
		return median(ds)
	}
	total := pick(func(t snapshot.CloneTiming) time.Duration { return t.Total })
	fmt.Printf("cold boot to agent-ready (median of %d)   %8.0f ms\n", e.boots, ms(median(boot)))
	fmt.Printf("snapshot pause (source box)              %8.0f ms   (snapshot size %s)\n", ms(e.warmPause), domain.FormatSize(snap.SizeBytes))
	fmt.Printf("warm clone to ready (median of %d)       %8.0f ms\n", e.n, ms(total))
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
	m := median(removes)
	fmt.Printf("rm --force of a running clone (median of %d) %5.0f ms   (clone + rm %0.f ms; rm/clone %.2f)\n",
		len(removes), ms(m), ms(total+m), float64(m)/float64(total))
	fmt.Printf("ratio warm clone / cold boot: %.3f\n", float64(total)/float64(median(boot)))
	return nil
}
