package main

import (
	"context"
	"fmt"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
)

// lifeRuns is how many suspend/resume rounds are timed per box.
const lifeRuns = 3

// benchLifecycle times kvbox suspend (the pause: the guest stopped until its
// state is saved; and the whole command, QEMU gone) and kvbox resume (until
// the agent answers) of a box booted from an image and of a clone (its first
// suspend copies the RAM live; once resumed its RAM is its own file), with a
// kvbox snapshot of the same box for the snapshot pause, against libvirt's
// managed save (`virsh managedsave`, the box is down for all of it) and
// `virsh start` of the saved box (plus the agent's first answer), in the
// same run.
func benchLifecycle(ctx context.Context, e *env) error {
	fmt.Printf("tiny box, %s RAM, 1 vCPU; %d rounds each; resume = until the agent answers\n", base.FormatSize(e.memBytes), lifeRuns)
	src := "bench-life-src"
	if _, err := e.create(ctx, e.spec(src, 1)); err != nil {
		return err
	}
	e.cleanup = append(e.cleanup, func() { e.k.Remove(context.Background(), src, true) })
	a, err := suspendRounds(ctx, e, src)
	if err != nil {
		return err
	}
	// The snapshot pause of the same box, and warm clones of that snapshot
	// timed in the same run: the target resume is held to.
	snapName := "bench-life-warm"
	res, err := e.snapshot(ctx, src, snapName)
	if err != nil {
		return err
	}
	e.cleanup = append(e.cleanup, func() { e.k.RemoveSnapshot(context.Background(), snapName) })
	cl := "bench-life-clone"
	clones, err := warmClones(ctx, e, res.Snapshot, cl)
	if err != nil {
		return err
	}
	b, err := suspendRounds(ctx, e, cl)
	if err != nil {
		return err
	}
	msave, mstart, err := managedSaveRounds(ctx, e, "bench-life-peer")
	if err != nil {
		return err
	}

	row := func(what string, pause, total, resume time.Duration) {
		fmt.Printf("  %-44s pause %7.0f ms  command %7.0f ms  resume %7.0f ms\n", what, ms(pause), ms(total), ms(resume))
	}
	row("kvbox suspend/resume, box from an image", median(a.pause), median(a.suspend), median(a.resume))
	row("kvbox suspend/resume, clone (1st round)", b.pause[0], b.suspend[0], b.resume[0])
	if len(b.pause) > 1 {
		row("kvbox suspend/resume, resumed clone (2nd on)", median(b.pause[1:]), median(b.suspend[1:]), median(b.resume[1:]))
	}
	fmt.Printf("  %-44s pause %7.0f ms\n", "kvbox snapshot of the same box (for the target)", ms(res.Pause))
	fmt.Printf("  %-44s                                          %7.0f ms\n", "kvbox warm clone of it, same run (median)", ms(median(clones)))
	row("peer: virsh managedsave / virsh start", median(msave), median(msave), median(mstart))
	fmt.Printf("  ratio resume (box from an image) / virsh start: %.2f; suspend pause / managedsave: %.2f\n",
		float64(median(a.resume))/float64(median(mstart)), float64(median(a.pause))/float64(median(msave)))
	fmt.Printf("  ratio resume (box from an image) / warm clone in this run: %.2f\n", float64(median(a.resume))/float64(median(clones)))
	fmt.Printf("  targets: resume <= 500 ms (%s; the warm clone in this run: %s), suspend pause <= snapshot pause (%s)\n",
		verdict(median(a.resume) <= 500*time.Millisecond), verdict(median(clones) <= 500*time.Millisecond), verdict(median(a.pause) <= res.Pause))
	return nil
}

// rounds are the times of a box's suspend/resume rounds.
type rounds struct{ pause, suspend, resume []time.Duration }

// suspendRounds suspends and resumes a box lifeRuns times.
func suspendRounds(ctx context.Context, e *env, name string) (rounds, error) {
	var r rounds
	for range lifeRuns {
		s, err := e.k.Suspend(ctx, name, nil)
		if err != nil {
			return r, err
		}
		r.pause, r.suspend = append(r.pause, s.Pause), append(r.suspend, s.Total)
		res, err := e.k.Resume(ctx, name, 2*time.Minute, nil)
		if err != nil {
			return r, err
		}
		r.resume = append(r.resume, res.Total)
	}
	return r, nil
}

// warmClones times lifeRuns clones of snap; the first, named name, is kept.
func warmClones(ctx context.Context, e *env, snap snapshot.Snapshot, name string) ([]time.Duration, error) {
	var clones []time.Duration
	for i := range lifeRuns {
		n := name
		if i > 0 {
			n = fmt.Sprintf("%s-%d", name, i)
		}
		t0 := time.Now()
		if _, _, err := e.clone(ctx, snap, n); err != nil {
			return nil, err
		}
		clones = append(clones, time.Since(t0))
		e.cleanup = append(e.cleanup, func() { e.k.Remove(context.Background(), n, true) })
		if i > 0 {
			e.k.Remove(ctx, n, true)
		}
	}
	return clones, nil
}

// managedSaveRounds is the peer: libvirt's managed save of a box kvbox
// made, and virsh start of it until its agent answers.
func managedSaveRounds(ctx context.Context, e *env, peer string) (msave, mstart []time.Duration, err error) {
	peerBox, err := e.create(ctx, e.spec(peer, 1))
	if err != nil {
		return nil, nil, err
	}
	e.cleanup = append(e.cleanup, func() { e.k.Remove(context.Background(), peer, true) })
	for range lifeRuns {
		t0 := time.Now()
		if out, err := virsh(ctx, "managedsave", peer); err != nil {
			return nil, nil, fmt.Errorf("virsh managedsave: %v: %s", err, out)
		}
		msave = append(msave, time.Since(t0))
		t0 = time.Now()
		if out, err := virsh(ctx, "start", peer); err != nil {
			return nil, nil, fmt.Errorf("virsh start: %v: %s", err, out)
		}
		peerBox.State = domain.StateRunning
		if err := pingAgent(ctx, e.peer, peerBox.Box); err != nil {
			return nil, nil, err
		}
		mstart = append(mstart, time.Since(t0))
	}
	return msave, mstart, nil
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "missed"
}

// pingAgent waits until the box's agent answers.
func pingAgent(ctx context.Context, h *domain.Host, b domain.Box) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := h.Dial(actx, b)
		if err == nil {
			_, err = c.Ping(actx)
			c.Close()
		}
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("agent of %s: %w", b.Name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
