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
	"sync"
	"syscall"
	"time"
)

// Progress shows a build's stages: one line per stage with its time. On a
// terminal the running stage has a spinner, its elapsed time and the last
// line its tool printed; elsewhere only finished stages are printed.
type Progress struct {
	W   io.Writer // nil: print nothing
	TTY bool
	// Text, if set, is applied to what a tool printed before it is shown
	// on the status line (the CLI makes it printable).
	Text func(string) string
	mu   sync.Mutex
}

// Stage is one running step of a build.
type Stage struct {
	p      *Progress
	name   string
	start  time.Time
	mu     sync.Mutex
	status string
	stop   chan struct{}
	done   chan struct{}
}

var spinner = []string{"⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"}

// Printf prints a line between stages.
func (p *Progress) Printf(format string, args ...any) {
	if p == nil || p.W == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.W, format, args...)
}

// Start begins a stage; End it with its error.
func (p *Progress) Start(name string) *Stage {
	s := &Stage{p: p, name: name, start: time.Now(), stop: make(chan struct{}), done: make(chan struct{})}
	if p == nil || p.W == nil || !p.TTY {
		close(s.done)
		return s
	}
	go func() {
		defer close(s.done)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for i := 0; ; i++ {
			s.mu.Lock()
			st := s.status
			s.mu.Unlock()
			line := fmt.Sprintf("%s %s  %s", spinner[i%len(spinner)], s.name, fmtDur(time.Since(s.start)))
			if st != "" && p.Text != nil {
				st = p.Text(st)
			}
			if st != "" {
				line += "  " + st
			}
			p.mu.Lock()
			fmt.Fprintf(p.W, "\r%s\x1b[K", truncate(line, 100))
			p.mu.Unlock()
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
		}
	}()
	return s
}

// Status sets the detail shown next to a running stage on a terminal.
func (s *Stage) Status(st string) {
	s.mu.Lock()
	s.status = strings.TrimSpace(st)
	s.mu.Unlock()
}

// End finishes the stage and prints its line.
func (s *Stage) End(err error) error {
	select {
	case <-s.stop:
		return err // already ended
	default:
		close(s.stop)
	}
	<-s.done
	p := s.p
	if p == nil || p.W == nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.TTY {
		fmt.Fprint(p.W, "\r\x1b[K")
	}
	mark := "✓"
	if err != nil {
		mark = "✗"
	}
	fmt.Fprintf(p.W, "%s %s (%s)\n", mark, s.name, fmtDur(time.Since(s.start)))
	return err
}

func fmtDur(d time.Duration) string {
	if d < 10*time.Second {
		return fmt.Sprintf("%.1fs", d.Seconds())
	}
	if d < time.Minute {
		return fmt.Sprintf("%.0fs", d.Seconds())
	}
	return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
}

func truncate(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

// runTool runs a build tool. Its output goes to the stage's status line and
// the last lines of it into the error when it fails. Cancelling ctx sends
// SIGTERM first (debootstrap unmounts what it mounted on its way out), then
// SIGKILL after a grace period.
func runTool(ctx context.Context, st *Stage, env []string, name string, args ...string) error {
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
func makeExt4Qcow2(ctx context.Context, st *Stage, root, raw, out, label string, size int64) error {
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
