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

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/kvbox"
)

// snapRuns is how many times each kind of snapshot is timed: the issue's
// targets are medians of 5.
const snapRuns = 5

// snapCase is one size the snapshot table is measured at.
type snapCase struct {
	what   string
	prefix string // of the boxes' and snapshots' names
	spec   func(name string) kvbox.CreateRequest
	// fill runs in each source box (and the peer) before its first
	// snapshot; cloneFill in the clone before its snapshots.
	fill, cloneFill string
}

// benchSnapshot is the snapshot table for the tiny box (512 MiB,
// left idle: about 70 MB touched).
func benchSnapshot(ctx context.Context, e *env) error {
	mem := max(e.memBytes, 512<<20)
	return snapshotTable(ctx, e, snapCase{
		what:   fmt.Sprintf("tiny box, %s RAM, 1 vCPU", base.FormatSize(mem)),
		prefix: "bench-snap",
		spec: func(name string) kvbox.CreateRequest {
			s := e.spec(name, 1)
			s.MemoryBytes = mem
			return s
		},
	})
}

// benchSnapshotDebian is the snapshot table at the real size: the
// Debian image, 4 GiB RAM, 2 vCPUs, about 1.5 GB touched (1.2 GB written to
// /dev/shm); the clone writes 100 MB before its snapshots.
func benchSnapshotDebian(ctx context.Context, e *env) error {
	im, err := (image.Store{Dir: e.stateDir + "/images"}).Get("debian")
	if err != nil {
		return fmt.Errorf("the Debian image: %w (make testenv builds it)", err)
	}
	return snapshotTable(ctx, e, snapCase{
		what:   "Debian, 4 GiB RAM, 2 vCPU, ~1.5 GB touched",
		prefix: "bench-dsnap",
		spec: func(name string) kvbox.CreateRequest {
			return debianSpec(im, name, 2)
		},
		fill:      "yes kvbox-bench-touched-page | head -c 1200M > /dev/shm/fill && sync",
		cloneFill: "head -c 100M /dev/urandom > /dev/shm/clone-wrote && sync",
	})
}

// snapshotTable times kvbox's snapshots of a running source box (its first
// and its later ones) and of a running clone, each with the pause kvbox
// reports and the longest gap in the box's replies to a ping every 5 ms,
// against the peers `virsh save` (the box is down for the whole save) and
// libvirt's external live snapshot (`virsh snapshot-create-as --live`) of
// a box of the same size, in the same run.
func snapshotTable(ctx context.Context, e *env, sc snapCase) error {
	fmt.Printf("%s; %d of each; gap = longest gap between replies to ping -i 0.005\n", sc.what, snapRuns)
	fill := func(box, script string) error {
		if script == "" {
			return nil
		}
		_, err := e.kvboxCLI(ctx, "exec", box, "--", "sh", "-c", script)
		return err
	}

	// (a) kvbox: snapshots of a source box.
	src := sc.prefix + "-src"
	srcBox, err := e.create(ctx, sc.spec(src))
	if err != nil {
		return err
	}
	e.cleanup = append(e.cleanup, func() { e.k.Remove(context.Background(), src, true) })
	if err := fill(src, sc.fill); err != nil {
		return err
	}
	idle, err := baselineGap(ctx, srcBox.IP)
	if err != nil {
		return err
	}
	var a kvSnaps
	if err := a.takeAll(ctx, e, src, srcBox.IP, sc.prefix+"-s", "the RAM its guest touched, and its own"); err != nil {
		return err
	}

	// (b) kvbox: snapshots of a clone of the first one.
	snap, err := e.k.GetSnapshot(ctx, sc.prefix+"-s0")
	if err != nil {
		return err
	}
	cl := sc.prefix + "-clone"
	clBox, _, err := e.clone(ctx, snap, cl)
	if err != nil {
		return err
	}
	e.cleanup = append(e.cleanup, func() { e.k.Remove(context.Background(), cl, true) })
	if err := fill(cl, sc.cloneFill); err != nil {
		return err
	}
	var b kvSnaps
	if err := b.takeAll(ctx, e, cl, clBox.IP, sc.prefix+"-c", "the snapshot's pages its guest read or wrote, and its own"); err != nil {
		return err
	}

	// (c), (d): peers on a box kvbox made, driven by virsh.
	pr, err := benchSnapshotPeers(ctx, e, sc.spec(sc.prefix+"-peer"), func(box string) error { return fill(box, sc.fill) })
	if err != nil {
		return err
	}
	printSnapshotTable(idle, a, b, pr)
	return nil
}

// writeTime is how long writing n bytes (not zeros) to a new file in dir
// and syncing it takes: what a snapshot of that size must at least spend.
func writeTime(dir string, n int64) (time.Duration, error) {
	f, err := os.CreateTemp(dir, ".bench-write-")
	if err != nil {
		return 0, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	buf := bytes.Repeat([]byte("kvbox-bench-write-time\n"), 4<<20/23)
	t0 := time.Now()
	for left := n; left > 0; left -= int64(len(buf)) {
		if _, err := f.Write(buf[:min(left, int64(len(buf)))]); err != nil {
			return 0, err
		}
	}
	if err := f.Sync(); err != nil {
		return 0, err
	}
	return time.Since(t0), nil
}

func printSnapshotTable(idle time.Duration, a, b kvSnaps, pr peerSnaps) {
	fmt.Printf("ping gap with no snapshot (1 s, box idle)   %8.0f ms\n", ms(idle))
	a.print("kvbox snapshot of a source box")
	a.printRatio()
	b.print("kvbox snapshot of a clone")
	b.printRatio()
	fmt.Printf("peer virsh save (box down throughout)       %8.0f ms   (file %s)\n", ms(median(pr.save)), base.FormatSize(pr.saveSize))
	if pr.liveNote != "" {
		fmt.Printf("peer virsh snapshot-create-as --live        %s\n", pr.liveNote)
	} else {
		fmt.Printf("peer virsh snapshot-create-as --live total  %8.0f ms   ping gap %6.0f ms\n", ms(median(pr.live)), ms(median(pr.liveGap)))
	}
	ratio := func(what string, k kvSnaps) {
		fmt.Printf("ratio virsh save downtime / kvbox pause, %s: %.1f (by ping gap %.1f)\n",
			what, float64(median(pr.save))/float64(median(k.pause)), float64(median(pr.save))/float64(median(k.gap)))
		if pr.liveNote == "" {
			fmt.Printf("ratio virsh --live ping gap / kvbox ping gap, %s: %.1f\n", what, float64(median(pr.liveGap))/float64(median(k.gap)))
		}
	}
	ratio("source", a)
	ratio("clone", b)
}

// peerSnaps are the timings of the peers: virsh save, and libvirt's
// external live snapshot.
type peerSnaps struct {
	save, live, liveGap []time.Duration
	saveSize            int64
	liveNote            string // why there is no live figure
}

// benchSnapshotPeers times `virsh save` + `restore` and `virsh
// snapshot-create-as --live` on a box of spec kvbox made (and filled).
func benchSnapshotPeers(ctx context.Context, e *env, spec kvbox.CreateRequest, fill func(box string) error) (peerSnaps, error) {
	var r peerSnaps
	peer := spec.Name
	peerBox, err := e.create(ctx, spec)
	if err != nil {
		return r, err
	}
	e.cleanup = append(e.cleanup, func() { e.k.Remove(context.Background(), peer, true) })
	if err := fill(peer); err != nil {
		return r, err
	}
	tmp, err := os.MkdirTemp(e.stateDir, peer+"-tmp-")
	if err != nil {
		return r, err
	}
	e.cleanup = append(e.cleanup, func() { os.RemoveAll(tmp) })
	if err := e.peer.ChownForQEMU(tmp); err != nil {
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
	disk := peerBox.Disk()
	for i := range snapRuns {
		name := fmt.Sprintf("%s-live%d", peer, i)
		mf, df := filepath.Join(tmp, name+".mem"), filepath.Join(tmp, name+".qcow2")
		// kvbox's boxes run under a static DAC label (relabel='no'):
		// libvirt would create the new overlay as root and QEMU could not
		// open it. Made here for QEMU, on the disk the box runs on now.
		if err := overlayFor(ctx, e, disk, df); err != nil {
			return r, err
		}
		disk = df
		p, err := startPing(ctx, peerBox.IP)
		if err != nil {
			return r, err
		}
		t0 := time.Now()
		out, verr := virsh(ctx, "snapshot-create-as", peer, name, "--live", "--no-metadata", "--reuse-external",
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

// overlayFor creates a qcow2 over disk at path, owned by QEMU's user.
func overlayFor(ctx context.Context, e *env, disk, path string) error {
	if out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", disk, path).CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img create %s: %v: %s", path, err, out)
	}
	return e.peer.ChownForQEMU(path)
}

// kvSnaps are the timings of kvbox snapshots of one box.
type kvSnaps struct {
	pause, total, gap []time.Duration
	steps             map[string][]time.Duration
	order             []string        // step names as Create reports them
	switchover        []time.Duration // pause before the steps after the stop: QEMU's last pass + device state
	// write is, for each snapshot, how long writing its size to a new
	// file on the same disk and syncing it took, right after it: the disk
	// here writes 1.5 GB in 1.5 s at one moment and in 12 s a minute
	// later (the host under this machine caches writes), and a set and
	// its reference must meet the same disk.
	write  []time.Duration
	sizes  []int64 // each snapshot's
	memory string  // what the host's memory did
}

// size is the first snapshot's size.
func (k *kvSnaps) size() int64 { return k.sizes[0] }

// takeAll takes snapRuns snapshots of box, named prefix0, prefix1, ...,
// and notes the host's memory around the first (resident says what the
// box's QEMU holds resident before it).
func (k *kvSnaps) takeAll(ctx context.Context, e *env, box, ip, prefix, resident string) error {
	before := hostMemory(box)
	for i := range snapRuns {
		if err := k.take(ctx, e, box, ip, fmt.Sprintf("%s%d", prefix, i)); err != nil {
			return err
		}
		if i == 0 {
			m := hostMemory(box)
			k.memory = fmt.Sprintf("host memory around the first: page cache %s -> %s (the snapshot written: %s), QEMU resident (VmRSS: %s) %s -> %s",
				base.FormatSize(before.cached), base.FormatSize(m.cached), base.FormatSize(k.size()),
				resident, base.FormatSize(before.qemu), base.FormatSize(m.qemu))
		}
		w, err := writeTime(e.stateDir, k.sizes[i])
		if err != nil {
			return err
		}
		k.write = append(k.write, w)
	}
	return nil
}

// memUse is the host's page cache and what a box's QEMU holds resident.
type memUse struct{ cached, qemu int64 }

// hostMemory measures memUse.
func hostMemory(box string) memUse {
	var m memUse
	field := func(file, name string) int64 {
		b, _ := os.ReadFile(file)
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == name {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				return kb << 10
			}
		}
		return 0
	}
	m.cached = field("/proc/meminfo", "Cached:")
	if pid, err := os.ReadFile("/run/libvirt/qemu/" + box + ".pid"); err == nil {
		m.qemu = field("/proc/"+strings.TrimSpace(string(pid))+"/status", "VmRSS:")
	}
	return m
}

func (k *kvSnaps) take(ctx context.Context, e *env, box, ip, name string) error {
	p, err := startPing(ctx, ip)
	if err != nil {
		return err
	}
	t0 := time.Now()
	res, err := e.snapshot(ctx, box, name)
	t1 := time.Now()
	gap := p.stop(t0, t1)
	if err != nil {
		return err
	}
	e.cleanup = append(e.cleanup, func() { e.k.RemoveSnapshot(context.Background(), name) })
	k.pause = append(k.pause, res.Pause)
	k.total = append(k.total, t1.Sub(t0))
	k.gap = append(k.gap, gap)
	k.sizes = append(k.sizes, res.Snapshot.SizeBytes)
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
		case "open-disk-copy", "start-disk-copy", "resume":
			after += s.Duration
		}
	}
	k.switchover = append(k.switchover, max(0, res.Pause-after))
	return nil
}

// printRatio holds the snapshots' totals against the median of their
// writes: a single write lands in a fast or a slow phase of a shared disk,
// the median of five says what writing that size costs here.
func (k *kvSnaps) printRatio() {
	w := max(median(k.write), 1)
	fmt.Printf("  writing each one's size to this disk and syncing, right after it: %s ms (median %.0f); total / that median: first %.1f, later ones (median) %.1f (target <= 2)\n",
		runs(k.write), ms(w), float64(k.total[0])/float64(w), float64(median(k.total[1:]))/float64(w))
}

// runs lists durations in ms, each run's: "12/15/11".
func runs(ds []time.Duration) string {
	var s []string
	for _, d := range ds {
		s = append(s, fmt.Sprintf("%.0f", ms(d)))
	}
	return strings.Join(s, "/")
}

func (k *kvSnaps) print(what string) {
	fmt.Printf("%-43s pause %6.0f ms   ping gap %6.0f ms   total %6.0f ms   (size %s)\n",
		what, ms(median(k.pause)), ms(median(k.gap)), ms(median(k.total)), base.FormatSize(k.size()))
	if len(k.pause) > 1 {
		fmt.Printf("  first: pause %.0f ms, ping gap %.0f ms; later ones: pause %.0f ms, ping gap %.0f ms\n",
			ms(k.pause[0]), ms(k.gap[0]), ms(median(k.pause[1:])), ms(median(k.gap[1:])))
	}
	fmt.Printf("  runs: pause %s ms (QEMU stopped, kvbox not yet: %s), ping gap %s ms, total %s ms\n", runs(k.pause), runs(k.switchover), runs(k.gap), runs(k.total))
	if k.memory != "" {
		fmt.Printf("  %s\n", k.memory)
	}
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
