package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// benchCp times kvbox cp of a 32 MiB file into and out of a box (to a
// tmpfs, so the guest's disk is out of it) against the peer measured in
// the same run: the bare exec channel (`exec -- sh -c 'cat >/dev/null'` in,
// `exec -- cat FILE` out; and `cat > FILE` on the same tmpfs, which adds
// the guest's write to the bare channel). Besides wall time it prints the box's QEMU CPU
// time per transfer: under TCG the guest's CPU is what bounds a copy, and
// CPU time is steadier than wall time on a shared machine.
func benchCp(ctx context.Context, e *env) error {
	if _, err := os.Stat("bin/kvbox"); err != nil {
		return fmt.Errorf("bin/kvbox: %w (make bench builds it)", err)
	}
	const size = 32 << 20
	b := "bench-cp"
	if _, err := e.kvboxCLI(ctx, "new", "--image", e.im.Name, "--cpus", "1", "--memory", "512M", b); err != nil {
		return err
	}
	defer e.kvboxCLI(context.Background(), "rm", "--force", b)
	if _, err := e.kvboxCLI(ctx, "exec", b, "--", "sh", "-c", "mkdir -p /mnt/ram && mount -t tmpfs -o size=100m tmpfs /mnt/ram"); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "kvbox-bench-cp-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	src := filepath.Join(dir, "f")
	f, err := os.Create(src)
	if err != nil {
		return err
	}
	if _, err := io.CopyN(f, rand.Reader, size); err != nil {
		return err
	}
	f.Close()
	qemu := qemuPid(b)

	order := []string{"cp in", "peer exec stdin", "peer stdin > tmpfs", "cp out", "peer exec stdout"}
	t := &cpTimes{ctx: ctx, e: e, qemu: qemu, res: map[string]*cpTime{}}
	for _, k := range order {
		t.res[k] = &cpTime{}
	}
	run, res := t.run, t.res
	for range 3 {
		if err := run("cp in", "", "", "cp", src, b+":/mnt/ram/f"); err != nil {
			return err
		}
		if err := run("peer exec stdin", src, "", "exec", b, "--", "sh", "-c", "cat > /dev/null"); err != nil {
			return err
		}
		if err := run("peer stdin > tmpfs", src, "", "exec", b, "--", "sh", "-c", "cat > /mnt/ram/g"); err != nil {
			return err
		}
		os.Remove(filepath.Join(dir, "back"))
		if err := run("cp out", "", "", "cp", b+":/mnt/ram/f", filepath.Join(dir, "back")); err != nil {
			return err
		}
		if err := run("peer exec stdout", "", os.DevNull, "exec", b, "--", "cat", "/mnt/ram/f"); err != nil {
			return err
		}
	}
	mbs := func(d time.Duration) float64 { return float64(size) / 1e6 / d.Seconds() }
	fmt.Printf("cp of %d MiB (tiny box, 1 vCPU, tmpfs in the box), medians of 3:\n", size>>20)
	for _, k := range order {
		w, c := median(res[k].wall), median(res[k].cpu)
		fmt.Printf("  %-17s %6.1f MB/s wall (%6.0f ms)   QEMU CPU %6.0f ms = %5.1f MB per CPU-second\n", k, mbs(w), ms(w), ms(c), mbs(c))
	}
	ratio := func(a, b string) float64 { return float64(median(res[a].cpu)) / float64(median(res[b].cpu)) }
	fmt.Printf("  QEMU CPU ratio cp/peer: in %.2f, out %.2f\n", ratio("cp in", "peer exec stdin"), ratio("cp out", "peer exec stdout"))
	return nil
}

// qemuPid finds the QEMU of box name ("guest=NAME," on its command line).
func qemuPid(name string) int {
	ents, _ := os.ReadDir("/proc")
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, _ := os.ReadFile("/proc/" + d.Name() + "/cmdline")
		if strings.Contains(string(b), "guest="+name+",") {
			return pid
		}
	}
	return 0
}

// procCPU is the user+system CPU time of pid so far (0 when unknown).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil || pid == 0 {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	k, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+k) * time.Second / 100 // USER_HZ
}

// cpTime is the wall and QEMU CPU times of one kind of transfer.
type cpTime struct{ wall, cpu []time.Duration }

// cpTimes times CLI transfers against one box's QEMU.
type cpTimes struct {
	ctx  context.Context
	e    *env
	qemu int
	res  map[string]*cpTime
}

// run times `kvbox args...` as kind k, with stdin and stdout from and to
// files when named.
func (t *cpTimes) run(k string, stdin, stdout string, args ...string) error {
	c0 := procCPU(t.qemu)
	cmd := exec.CommandContext(t.ctx, "bin/kvbox", append([]string{"--state-dir", t.e.stateDir}, args...)...)
	if stdin != "" {
		in, err := os.Open(stdin)
		if err != nil {
			return err
		}
		defer in.Close()
		cmd.Stdin = in
	}
	if stdout != "" {
		out, err := os.Create(stdout)
		if err != nil {
			return err
		}
		defer out.Close()
		cmd.Stdout = out
	}
	var errb strings.Builder
	cmd.Stderr = &errb
	if cmd.Stdout == nil {
		cmd.Stdout = &errb
	}
	t0 := time.Now()
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("kvbox %s: %v %s", strings.Join(args, " "), err, errb.String())
	}
	t.res[k].wall = append(t.res[k].wall, time.Since(t0))
	t.res[k].cpu = append(t.res[k].cpu, procCPU(t.qemu)-c0)
	return nil
}
