package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// kvboxCLI runs bin/kvbox (make bench builds it) against the bench's
// state dir, as a user would: its time includes connecting to libvirt.
func (e *env) kvboxCLI(ctx context.Context, args ...string) (time.Duration, error) {
	cmd := exec.CommandContext(ctx, "bin/kvbox", append([]string{"--state-dir", e.stateDir}, args...)...)
	t0 := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("kvbox %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return time.Since(t0), nil
}

// benchCycle times, through the CLI, what a job does with a warm clone:
// `exec true` on a running clone, the whole job cycle (new --from, exec
// true, rm --force), ten clones started at once (wall time, host CPU and
// PSS of each QEMU), and the peer `virsh restore` of a saved clone.
func benchCycle(ctx context.Context, e *env) error {
	snap, err := e.warmSnapshot(ctx)
	if err != nil {
		return err
	}
	if _, err := os.Stat("bin/kvbox"); err != nil {
		return fmt.Errorf("bin/kvbox: %w (make bench builds it)", err)
	}
	c := "bench-cyc-exec"
	if _, err := e.kvboxCLI(ctx, "new", "--from", snap.Name, c); err != nil {
		return err
	}
	var execs []time.Duration
	for range 10 {
		d, err := e.kvboxCLI(ctx, "exec", c, "--", "true")
		if err != nil {
			e.kvboxCLI(context.Background(), "rm", "--force", c)
			return err
		}
		execs = append(execs, d)
	}

	restore := virshRestorePeer(ctx, e, c)
	if _, err := e.kvboxCLI(ctx, "rm", "--force", c); err != nil {
		return err
	}
	news, cycles, err := jobCycles(ctx, e, snap.Name)
	if err != nil {
		return err
	}

	const par = 10
	wall, rmWall, busy, pss, err := benchParallel(ctx, e, snap.Name, par)
	if err != nil {
		return err
	}

	cli := median(news)
	fmt.Printf("kvbox exec BOX -- true (CLI, median of %d)   %6.0f ms\n", len(execs), ms(median(execs)))
	fmt.Printf("kvbox new --from (CLI, median of %d)          %6.0f ms\n", len(news), ms(cli))
	fmt.Printf("job cycle new --from + exec true + rm (median of %d) %6.0f ms\n", len(cycles), ms(median(cycles)))
	if restore > 0 {
		fmt.Printf("peer virsh restore of a saved clone           %6.0f ms   (ratio virsh restore / kvbox new --from: %.1fx)\n", ms(restore), float64(restore)/float64(cli))
	}
	fmt.Printf("%d clones started at once: wall %.2f s (%.1f clones/s); rm of all %d: %.2f s\n", par, wall.Seconds(), par/wall.Seconds(), par, rmWall.Seconds())
	if len(pss) > 0 {
		var sum int64
		for _, p := range pss {
			sum += p
		}
		fmt.Printf("  PSS per clone's QEMU: mean %.1f MB over %d clones\n", float64(sum)/float64(len(pss))/1024, len(pss))
	}
	if busy > 0 {
		per := busy / par
		fmt.Printf("  host CPU busy while they started: %.1f s, %.2f s per clone: at most %.1f clones/s on %d cores\n",
			busy.Seconds(), per.Seconds(), float64(runtime.NumCPU())/per.Seconds(), runtime.NumCPU())
	}
	return nil
}

// hostBusy is the host's CPU time spent so far: user, nice, system, irq and
// softirq of /proc/stat (in USER_HZ ticks of 10 ms; guest time is already
// in user); 0 when it cannot be read.
func hostBusy() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" { // cpu user nice system idle iowait irq softirq ...
		return 0
	}
	var ticks int64
	for _, v := range []string{f[1], f[2], f[3], f[6], f[7]} {
		n, _ := strconv.ParseInt(v, 10, 64)
		ticks += n
	}
	return time.Duration(ticks) * 10 * time.Millisecond
}

// virshRestorePeer is the peer: virsh save of the clone, then virsh
// restore of that file (0 when either failed, which it says).
func virshRestorePeer(ctx context.Context, e *env, c string) time.Duration {
	sav := filepath.Join(e.stateDir, "bench-cyc.sav")
	defer os.Remove(sav)
	if out, err := exec.CommandContext(ctx, "virsh", "save", c, sav).CombinedOutput(); err != nil {
		fmt.Printf("peer virsh save failed: %v %s\n", err, strings.TrimSpace(string(out)))
		return 0
	}
	t0 := time.Now()
	out, err := exec.CommandContext(ctx, "virsh", "restore", sav).CombinedOutput()
	if err != nil {
		fmt.Printf("peer virsh restore failed: %v %s\n", err, strings.TrimSpace(string(out)))
		return 0
	}
	return time.Since(t0)
}

// jobCycles times five job cycles through the CLI: new --from, exec true,
// rm --force; news are the new --from parts.
func jobCycles(ctx context.Context, e *env, snap string) (news, cycles []time.Duration, err error) {
	for i := range 5 {
		n := fmt.Sprintf("bench-cyc-%d", i)
		t0 := time.Now()
		dn, err := e.kvboxCLI(ctx, "new", "--from", snap, n)
		if err == nil {
			_, err = e.kvboxCLI(ctx, "exec", n, "--", "true")
		}
		if _, rerr := e.kvboxCLI(context.Background(), "rm", "--force", n); err == nil {
			err = rerr
		}
		if err != nil {
			return nil, nil, err
		}
		news, cycles = append(news, dn), append(cycles, time.Since(t0))
	}
	return news, cycles, nil
}

// benchParallel starts par clones of snap at once through the CLI and
// returns the wall time, the wall time of one rm of them all, the host CPU
// time the starts took (hostBusy) and the PSS (KiB) of each one's QEMU.
func benchParallel(ctx context.Context, e *env, snap string, par int) (wall, rmWall, busy time.Duration, pss []int64, err error) {
	names := make([]string, par)
	errs := make([]error, par)
	var wg sync.WaitGroup
	t0, busy0 := time.Now(), hostBusy()
	for i := range par {
		names[i] = fmt.Sprintf("bench-par-%d", i)
		wg.Add(1)
		go func() { defer wg.Done(); _, errs[i] = e.kvboxCLI(ctx, "new", "--from", snap, names[i]) }()
	}
	wg.Wait()
	wall, busy = time.Since(t0), hostBusy()-busy0
	for i, n := range names {
		if errs[i] == nil {
			if kb, err := qemuPSS(n); err == nil {
				pss = append(pss, kb)
			}
		}
	}
	t0 = time.Now()
	if _, err := e.kvboxCLI(context.Background(), append([]string{"rm", "--force"}, names...)...); err != nil {
		return 0, 0, 0, nil, err
	}
	rmWall = time.Since(t0)
	for _, err := range errs {
		if err != nil {
			return 0, 0, 0, nil, err
		}
	}
	return wall, rmWall, busy, pss, nil
}

// qemuPSS is the proportional set size (KiB) of the named domain's QEMU.
func qemuPSS(name string) (int64, error) {
	b, err := os.ReadFile(filepath.Join("/run/libvirt/qemu", name+".pid"))
	if err != nil {
		return 0, err
	}
	s, err := os.ReadFile(filepath.Join("/proc", strings.TrimSpace(string(b)), "smaps_rollup"))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(s), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "Pss:" {
			return strconv.ParseInt(f[1], 10, 64)
		}
	}
	return 0, fmt.Errorf("no Pss in smaps_rollup of %s", name)
}
