package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
)

// snapRuns is how many times each kind of snapshot is timed.
const snapRuns = 3

// benchSnapshot times kvbox's snapshot of a running source box and of a
// running clone (the live path), each with the pause kvbox reports and the
// longest gap in the box's replies to a ping every 5 ms, against the peers
// `virsh save` (the box is down for the whole save) and libvirt's external
// live snapshot (`virsh snapshot-create-as --live`), in the same run.
func benchSnapshot(ctx context.Context, e *env) error {
	mem := max(e.memBytes, 512<<20) // the tiny target is a 512 MiB box
	spec := func(name string) domain.Spec {
		s := e.spec(name, 1)
		s.MemoryBytes = mem
		return s
	}
	fmt.Printf("tiny box, %s RAM, 1 vCPU; median of %d each; gap = longest gap between replies to ping -i 0.005\n",
		domain.FormatSize(mem), snapRuns)
	st := snapshot.Store{Dir: e.stateDir + "/snapshots"}

	// (a) kvbox: snapshots of a source box.
	src := "bench-snap-src"
	srcBox, err := e.h.Create(ctx, spec(src))
	if err != nil {
		return err
	}
	e.cleanup = append(e.cleanup, func() { e.h.Remove(context.Background(), src, true) })
	base, err := baselineGap(ctx, srcBox.IP)
	if err != nil {
		return err
	}
	var a kvSnaps
	for i := range snapRuns {
		if err := a.take(ctx, e, st, src, srcBox.IP, fmt.Sprintf("bench-snap-s%d", i)); err != nil {
			return err
		}
	}

	// (b) kvbox: snapshots of a clone of the first one (the live copy).
	snap, err := st.Get("bench-snap-s0")
	if err != nil {
		return err
	}
	cl := "bench-snap-clone"
	clBox, _, err := snapshot.Clone(ctx, e.h, snap, cl, 2*time.Minute)
	if err != nil {
		return err
	}
	e.cleanup = append(e.cleanup, func() { e.h.Remove(context.Background(), cl, true) })
	var b kvSnaps
	for i := range snapRuns {
		if err := b.take(ctx, e, st, cl, clBox.IP, fmt.Sprintf("bench-snap-c%d", i)); err != nil {
			return err
		}
	}

	// (c), (d): peers on a box kvbox made, driven by virsh.
	pr, err := benchSnapshotPeers(ctx, e, spec("bench-snap-peer"))
	if err != nil {
		return err
	}
	save, saveSize, live, liveGap, liveNote := pr.save, pr.saveSize, pr.live, pr.liveGap, pr.liveNote

	fmt.Printf("ping gap with no snapshot (1 s, box idle)   %8.0f ms\n", ms(base))
	a.print("kvbox snapshot of a source box")
	b.print("kvbox snapshot of a clone (live copy)")
	fmt.Printf("peer virsh save (box down throughout)       %8.0f ms   (file %s)\n", ms(median(save)), domain.FormatSize(saveSize))
	if liveNote != "" {
		fmt.Printf("peer virsh snapshot-create-as --live        %s\n", liveNote)
	} else {
		fmt.Printf("peer virsh snapshot-create-as --live total  %8.0f ms   ping gap %6.0f ms\n", ms(median(live)), ms(median(liveGap)))
	}
	ratio := func(what string, k kvSnaps) {
		fmt.Printf("ratio virsh save downtime / kvbox pause, %s: %.1f (by ping gap %.1f)\n",
			what, float64(median(save))/float64(median(k.pause)), float64(median(save))/float64(median(k.gap)))
		if liveNote == "" {
			fmt.Printf("ratio virsh --live ping gap / kvbox ping gap, %s: %.1f\n", what, float64(median(liveGap))/float64(median(k.gap)))
		}
	}
	ratio("source", a)
	ratio("clone", b)
	return nil
}

// peerSnaps are the timings of the peers: virsh save, and libvirt's
// external live snapshot.
type peerSnaps struct {
	save, live, liveGap []time.Duration
	saveSize            int64
	liveNote            string // why there is no live figure
}

// benchSnapshotPeers times `virsh save` + `restore` and `virsh
// snapshot-create-as --live` on a box of spec kvbox made.
func benchSnapshotPeers(ctx context.Context, e *env, spec domain.Spec) (peerSnaps, error) {
	var r peerSnaps
	peer := spec.Name
	peerBox, err := e.h.Create(ctx, spec)
	if err != nil {
		return r, err
	}
	e.cleanup = append(e.cleanup, func() { e.h.Remove(context.Background(), peer, true) })
	tmp, err := os.MkdirTemp(e.stateDir, "bench-snap-tmp-")
	if err != nil {
		return r, err
	}
	e.cleanup = append(e.cleanup, func() { os.RemoveAll(tmp) })
	if err := e.h.ChownForQEMU(tmp); err != nil {
		return r, err
	}
	for i := range snapRuns {
		f := filepath.Join(tmp, fmt.Sprintf("save-%d", i))
		t0 := time.Now()
		if out, err := virsh(ctx, "save", peer, f); err != nil {
			return r, fmt.Errorf("virsh save: %v: %s", err, out)
		}
		r.save = append(r.save, time.Since(t0))
		if fi, err := os.Stat(f); err == nil {
			r.saveSize = fi.Size()
		}
		if out, err := virsh(ctx, "restore", f); err != nil {
			return r, fmt.Errorf("virsh restore: %v: %s", err, out)
		}
		os.Remove(f)
	}
	for i := range snapRuns {
		name := fmt.Sprintf("bench-snap-live%d", i)
		mf, df := filepath.Join(tmp, name+".mem"), filepath.Join(tmp, name+".qcow2")
		p, err := startPing(ctx, peerBox.IP)
		if err != nil {
			return r, err
		}
		t0 := time.Now()
		out, verr := virsh(ctx, "snapshot-create-as", peer, name, "--live", "--no-metadata",
			"--memspec", "file="+mf+",snapshot=external", "--diskspec", "vda,snapshot=external,file="+df)
		total := time.Since(t0)
		gap := p.stop(t0, time.Now())
		if verr != nil {
			r.liveNote = "libvirt refused: " + firstLine(out)
			break
		}
		r.live = append(r.live, total)
		r.liveGap = append(r.liveGap, gap)
	}
	// The peer box now runs on overlays in tmp: it is removed with the
	// rest by the cleanup (rm --force, then tmp).
	return r, nil
}

// kvSnaps are the timings of kvbox snapshots of one box.
type kvSnaps struct {
	pause, total, gap []time.Duration
	steps             map[string][]time.Duration
	order             []string        // step names as Create reports them
	switchover        []time.Duration // pause before the steps after the stop: QEMU's last pass + device state
	size              int64
}

func (k *kvSnaps) take(ctx context.Context, e *env, st snapshot.Store, box, ip, name string) error {
	p, err := startPing(ctx, ip)
	if err != nil {
		return err
	}
	t0 := time.Now()
	res, err := snapshot.Create(ctx, e.h, st, box, name)
	t1 := time.Now()
	gap := p.stop(t0, t1)
	if err != nil {
		return err
	}
	e.cleanup = append(e.cleanup, func() { snapshot.Remove(e.h, st, name) })
	k.pause = append(k.pause, res.Pause)
	k.total = append(k.total, t1.Sub(t0))
	k.gap = append(k.gap, gap)
	k.size = res.Snapshot.SizeBytes
	if k.steps == nil {
		k.steps = map[string][]time.Duration{}
	}
	after := time.Duration(0) // the steps that run while the box is stopped, after QEMU stopped it
	for _, s := range res.Steps {
		if _, ok := k.steps[s.Name]; !ok {
			k.order = append(k.order, s.Name)
		}
		k.steps[s.Name] = append(k.steps[s.Name], s.Duration)
		switch s.Name {
		case "save-state", "copy-memory", "open-disk-copy", "start-disk-copy", "resume":
			after += s.Duration
		}
	}
	k.switchover = append(k.switchover, max(0, res.Pause-after))
	return nil
}

func (k *kvSnaps) print(what string) {
	fmt.Printf("%-43s pause %6.0f ms   ping gap %6.0f ms   total %6.0f ms   (size %s)\n",
		what, ms(median(k.pause)), ms(median(k.gap)), ms(median(k.total)), domain.FormatSize(k.size))
	runs := func(ds []time.Duration) string {
		var s []string
		for _, d := range ds {
			s = append(s, fmt.Sprintf("%.0f", ms(d)))
		}
		return strings.Join(s, "/")
	}
	fmt.Printf("  runs: pause %s ms, ping gap %s ms\n", runs(k.pause), runs(k.gap))
	for _, n := range k.order {
		fmt.Printf("  %-41s %6.0f ms\n", n, ms(median(k.steps[n])))
	}
	fmt.Printf("  %-41s %6.0f ms\n", "of the pause: QEMU stopped, kvbox not yet", ms(median(k.switchover)))
}

// pinger is `ping -i 0.005` to a box, recording when each reply came.
type pinger struct {
	cmd  *exec.Cmd
	mu   sync.Mutex
	at   []time.Time
	done chan struct{}
}

// startPing starts pinging ip and returns once the first reply came, so a
// gap at the start is not the ping warming up.
func startPing(ctx context.Context, ip string) (*pinger, error) {
	cmd := exec.CommandContext(ctx, "ping", "-n", "-D", "-i", "0.005", ip)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("ping: %w", err)
	}
	p := &pinger{cmd: cmd, done: make(chan struct{})}
	first := make(chan struct{})
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(out)
		once := false
		for sc.Scan() {
			// [1733225942.123456] 64 bytes from 10.0.0.2: icmp_seq=1 ttl=64 time=0.3 ms
			l := sc.Text()
			if !strings.HasPrefix(l, "[") || !strings.Contains(l, "bytes from") {
				continue
			}
			end := strings.IndexByte(l, ']')
			f, err := strconv.ParseFloat(l[1:end], 64)
			if err != nil {
				continue
			}
			t := time.Unix(0, int64(f*1e9))
			p.mu.Lock()
			p.at = append(p.at, t)
			p.mu.Unlock()
			if !once {
				once = true
				close(first)
			}
		}
	}()
	select {
	case <-first:
		return p, nil
	case <-time.After(10 * time.Second):
		p.kill()
		return nil, fmt.Errorf("no ping reply from %s in 10 s", ip)
	}
}

func (p *pinger) kill() {
	p.cmd.Process.Kill()
	<-p.done
	p.cmd.Wait()
}

// stop waits until replies flow again after t1 (at most 2 s), stops the
// ping and returns the longest gap between two replies that overlaps
// [t0, t1].
func (p *pinger) stop(t0, t1 time.Time) time.Duration {
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		p.mu.Lock()
		n := len(p.at)
		last := time.Time{}
		if n > 0 {
			last = p.at[n-1]
		}
		p.mu.Unlock()
		if last.After(t1.Add(50 * time.Millisecond)) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	p.kill()
	var g time.Duration
	for i := 1; i < len(p.at); i++ {
		a, b := p.at[i-1], p.at[i]
		if b.Before(t0) || a.After(t1) {
			continue
		}
		g = max(g, b.Sub(a))
	}
	return g
}

// baselineGap is the longest reply gap over one second with nothing going
// on: the floor under every gap this section reports.
func baselineGap(ctx context.Context, ip string) (time.Duration, error) {
	p, err := startPing(ctx, ip)
	if err != nil {
		return 0, err
	}
	t0 := time.Now()
	time.Sleep(time.Second)
	return p.stop(t0, time.Now()), nil
}

func virsh(ctx context.Context, args ...string) (string, error) {
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "virsh", append([]string{"-c", domain.DefaultURI(), "-q"}, args...)...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return strings.TrimSpace(out.String()), err
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}
