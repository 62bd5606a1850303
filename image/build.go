package image

import (
	"bufio"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"kvbox.dev/kvbox/progress"
)

// stage is one step of a build, told to a progress.Reporter: a
// progress.Stage while it runs (its status the last line its tool
// printed), then a log line with its time, "✓ name (1.2s)", or "✗ name
// (1.2s)" when it failed. The log lines are the build's record, the same
// on a terminal and in a CI log.
type stage struct {
	r     progress.Reporter
	live  progress.Stage
	name  string
	start time.Time
	ended bool
}

// startStage begins a stage; End it with its error.
func startStage(r progress.Reporter, name string) *stage {
	return &stage{r: r, live: r.Stage(name), name: name, start: time.Now()}
}

// Status says what the stage does now. A tool's line reaches people only
// this way, and in the error when the tool fails: the CLI's Reporter
// (terminal.Progress) and its error line make both printable.
func (s *stage) Status(line string) {
	s.live.Status(strings.TrimSpace(line))
}

// End ends the stage, logs its line and returns err. Ending it again does
// nothing.
func (s *stage) End(err error) error {
	if s.ended {
		return err
	}
	s.ended = true
	s.live.End()
	mark := "✓"
	if err != nil {
		mark = "✗"
	}
	s.r.Log(fmt.Sprintf("%s %s (%s)", mark, s.name, fmtDur(time.Since(s.start))))
	return err
}

// fmtDur is a stage's or a build's time: "1.2s", "42s", "3m05s".
func fmtDur(d time.Duration) string {
	if d < 10*time.Second {
		return fmt.Sprintf("%.1fs", d.Seconds())
	}
	if d < time.Minute {
		return fmt.Sprintf("%.0fs", d.Seconds())
	}
	return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
}

// runTool runs a build tool. Its output goes to the stage's status line and
// the last lines of it into the error when it fails. Cancelling ctx sends
// SIGTERM first (debootstrap unmounts what it mounted on its way out), then
// SIGKILL after a grace period.
func runTool(ctx context.Context, st *stage, env []string, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), "LC_ALL=C", "DEBIAN_FRONTEND=noninteractive",
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	cmd.Env = append(cmd.Env, env...)
	// The whole process group: debootstrap's dpkg and maintainer scripts too.
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	// Own process group: a Ctrl-C on the terminal reaches kvbox, which
	// then stops the tool itself, in order.
	// If kvbox is killed outright, the tool is told to stop too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var tail []string
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if st != nil {
				st.Status(line)
			}
			tail = append(tail, line)
			if len(tail) > 30 {
				tail = tail[1:]
			}
		}
		io.Copy(io.Discard, pr)
	}()
	err := cmd.Start()
	if err == nil {
		err = cmd.Wait()
	}
	pw.Close()
	<-scanned
	if ctx.Err() != nil && cmd.Process != nil {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // stragglers of the group
	}
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		msg := fmt.Sprintf("%s: %v", name, err)
		if len(tail) > 0 {
			msg += "; its last output:\n  " + strings.Join(tail, "\n  ")
		}
		return errors.New(msg)
	}
	return nil
}

// makeExt4Qcow2 writes a sparse raw ext4 filesystem of size bytes holding the
// tree at root (mkfs.ext4 -d: no loop device, no mount), then converts it
// to a sparse qcow2 at out.
func makeExt4Qcow2(ctx context.Context, st *stage, root, raw, out, label string, size int64) error {
	f, err := os.Create(raw)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := runTool(ctx, st, nil, "mkfs.ext4", "-q", "-F", "-L", label, "-E", "root_owner=0:0", "-d", root, raw); err != nil {
		return err
	}
	st.Status("qemu-img convert to qcow2")
	return runTool(ctx, st, nil, "qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, out)
}

// requireTools says which host tools are missing and which packages bring
// them.
func requireTools(tools map[string]string) error {
	var missing, pkgs []string
	seen := map[string]bool{}
	for t, pkg := range tools {
		if _, err := exec.LookPath(t); err != nil {
			if _, err := os.Stat(filepath.Join("/usr/sbin", t)); err == nil {
				continue
			}
			if _, err := os.Stat(filepath.Join("/sbin", t)); err == nil {
				continue
			}
			missing = append(missing, t)
			if !seen[pkg] {
				seen[pkg] = true
				pkgs = append(pkgs, pkg)
			}
		}
	}
	if missing != nil {
		return fmt.Errorf("missing host tools %s: apt-get install %s", strings.Join(missing, ", "), strings.Join(pkgs, " "))
	}
	return nil
}

// checkStaticELF makes sure path is a statically linked x86-64 Linux
// program: the agent runs in guests whatever their libc.
func checkStaticELF(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("agent %s: %w", path, err)
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 {
		return fmt.Errorf("agent %s is for %v, not x86-64", path, f.Machine)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("agent %s is dynamically linked: build it with CGO_ENABLED=0 (make build)", path)
		}
	}
	return nil
}

// FindAgent returns the kvbox-agent binary to put in images: explicit if
// given, else $KVBOX_AGENT, else next to the running kvbox (same folder,
// ../bin, ../lib/kvbox).
func FindAgent(explicit string) (string, error) {
	if explicit == "" {
		explicit = os.Getenv("KVBOX_AGENT")
	}
	if explicit != "" {
		p, err := filepath.Abs(explicit)
		if err != nil {
			return "", err
		}
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("agent: %w", err)
		}
		return p, checkStaticELF(p)
	}
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	if r, err := filepath.EvalSymlinks(exe); err == nil {
		exe = r
	}
	dir := filepath.Dir(exe)
	cands := []string{
		filepath.Join(dir, "kvbox-agent"),
		filepath.Join(dir, "..", "bin", "kvbox-agent"),
		filepath.Join(dir, "..", "lib", "kvbox", "kvbox-agent"),
	}
	for _, c := range cands {
		if fi, err := os.Stat(c); err == nil && fi.Mode().IsRegular() {
			return filepath.Clean(c), checkStaticELF(c)
		}
	}
	return "", fmt.Errorf("no kvbox-agent next to %s (looked in %s): build it with `make build`, or pass --agent", exe, strings.Join(cands, ", "))
}

// copyFile copies src to dst with mode.
func copyFile(dst, src string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Chmod(dst, mode)
}
