package main

// Published ports (kvbox new --publish) are held by a detached
// `kvbox port-forward --listen-fds` child per box: kvbox has no daemon, and
// a child that only holds one agent connection and the listening sockets is
// the smallest thing that can outlive the `new` command. `new` binds the
// sockets itself before it creates the box (a taken port fails the command
// with nothing created) and hands them to the child, which then only has
// to reach the agent. The child writes "ok" on a pipe once it carries
// traffic; a child that cannot reach the agent fails `new`, which removes
// the box. The child's pid and the ports are in publish.json in the box's
// folder: `ls --json` lists them, `rm` and `stop` end the child first. The
// child also ends on its own when the box's agent channel closes (QEMU
// gone: virsh destroy, a crash).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/domain"
)

const publishFile = "publish.json"

// publishRecord is publish.json.
type publishRecord struct {
	PID   int        `json:"pid"`
	Ports []portSpec `json:"ports"`
}

func readPublish(dir string) (publishRecord, bool) {
	var r publishRecord
	b, err := os.ReadFile(filepath.Join(dir, publishFile))
	if err != nil || json.Unmarshal(b, &r) != nil {
		return r, false
	}
	return r, true
}

// holderAlive reports whether pid is the port-forward child of box name.
func holderAlive(pid int, name string) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
	hasFwd, hasName := false, false
	for _, a := range args {
		hasFwd = hasFwd || a == "--listen-fds"
		hasName = hasName || a == name
	}
	return hasFwd && hasName
}

// publishedPorts is what ls shows: the ports of a live holder.
func publishedPorts(b domain.Box) []portSpec {
	r, ok := readPublish(b.Dir)
	if !ok || !holderAlive(r.PID, b.Name) {
		return nil
	}
	return r.Ports
}

// startPublish hands the bound listeners to a detached child that forwards
// them to box b until it stops or is removed, and waits until it runs.
func (a *app) startPublish(b domain.Box, specs []portSpec, ls []*net.TCPListener) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	for _, l := range ls {
		f, err := l.File()
		if err != nil {
			return err
		}
		files = append(files, f)
	}
	rp, wp, err := os.Pipe()
	if err != nil {
		return err
	}
	defer rp.Close()
	files = append(files, wp)
	logf, err := os.OpenFile(filepath.Join(b.Dir, "publish.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	files = append(files, logf)
	args := []string{"--state-dir", a.stateDir, "--connect", a.uri, "--dial-timeout", a.dialTimeout.String(),
		"port-forward", "--listen-fds", "--ready-fd", strconv.Itoa(3 + len(ls)), b.Name}
	for _, s := range specs {
		args = append(args, s.String())
	}
	cmd := exec.Command(self, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = files[:len(ls)+1]
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the port holder: %w", err)
	}
	wp.Close() // the child holds it now: its exit ends our read
	done := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(rp).ReadString('\n')
		done <- strings.TrimSpace(line)
	}()
	var line string
	select {
	case line = <-done:
	case <-time.After(a.dialTimeout + 5*time.Second):
		line = "no answer"
	}
	if line != "ok" {
		cmd.Process.Kill()
		cmd.Wait()
		why, ok := strings.CutPrefix(line, "error: ")
		if !ok {
			logged, _ := os.ReadFile(filepath.Join(b.Dir, "publish.log"))
			why = strings.TrimSpace(string(bytes.TrimPrefix(logged, []byte("kvbox: "))))
		}
		if why == "" {
			why = "the port holder ended at once"
		}
		return fmt.Errorf("publish ports of box %q: %s", b.Name, why)
	}
	rec, _ := json.Marshal(publishRecord{PID: cmd.Process.Pid, Ports: specs})
	if err := os.WriteFile(filepath.Join(b.Dir, publishFile), rec, 0o600); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return err
	}
	cmd.Process.Release()
	return nil
}

// stopPublish ends box b's port holder, if it has one, and waits until its
// sockets are closed.
func stopPublish(b domain.Box) error {
	r, ok := readPublish(b.Dir)
	if !ok || !holderAlive(r.PID, b.Name) {
		return nil
	}
	unix.Kill(r.PID, unix.SIGTERM)
	deadline := time.Now().Add(3 * time.Second)
	for holderAlive(r.PID, b.Name) {
		if time.Now().After(deadline) {
			unix.Kill(r.PID, unix.SIGKILL)
		}
		if time.Now().After(deadline.Add(2 * time.Second)) {
			return fmt.Errorf("box %q: its port holder (pid %d) does not end", b.Name, r.PID)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// signalReady tells the parent of a --listen-fds child that it runs.
func signalReady(fd int, err error) {
	if fd <= 0 {
		return
	}
	f := os.NewFile(uintptr(fd), "ready")
	defer f.Close()
	if err != nil {
		fmt.Fprintf(f, "error: %s\n", message(err))
		return
	}
	fmt.Fprintln(f, "ok")
}

func closeListeners(ls []*net.TCPListener) {
	for _, l := range ls {
		l.Close()
	}
}

// publish starts box b's --publish holder; if it cannot, the box is removed
// (new --publish gives the box with its ports or nothing).
func (a *app) publish(ctx context.Context, h *domain.Host, b domain.Box, o *newOptions) error {
	if len(o.ports) == 0 {
		return nil
	}
	if err := a.startPublish(b, o.ports, o.listeners); err != nil {
		if rerr := h.Remove(context.WithoutCancel(ctx), b.Name, true); rerr != nil {
			return fmt.Errorf("%w (and removing the box failed: %v)", err, rerr)
		}
		return fmt.Errorf("%w: box %s removed", err, b.Name)
	}
	for _, p := range o.ports {
		fmt.Fprintf(a.io.Out, "✓ published %s -> %s:%d (until the box stops or is removed)\n", p.listenAddr(), b.Name, p.GuestPort)
	}
	return nil
}

// boxJSON is a box in ls --json: with its published ports.
type boxJSON struct {
	domain.Box
	Published []portSpec `json:"published,omitempty"`
}

func withPublished(boxes []domain.Box) []boxJSON {
	out := make([]boxJSON, 0, len(boxes))
	for _, b := range boxes {
		out = append(out, boxJSON{Box: b, Published: publishedPorts(b)})
	}
	return out
}

// republish starts the holder of a box started again after stop with the
// ports it was created with.
func (a *app) republish(b domain.Box) error {
	r, ok := readPublish(b.Dir)
	if !ok || len(r.Ports) == 0 || holderAlive(r.PID, b.Name) {
		return nil
	}
	ls, err := listenAll(r.Ports)
	if err != nil {
		return fmt.Errorf("box %s is running, but not its published ports: %w", b.Name, err)
	}
	defer closeListeners(ls)
	if err := a.startPublish(b, r.Ports, ls); err != nil {
		return fmt.Errorf("box %s is running, but not its published ports: %w", b.Name, err)
	}
	for _, p := range r.Ports {
		fmt.Fprintf(a.io.Out, "✓ published %s -> %s:%d again\n", p.listenAddr(), b.Name, p.GuestPort)
	}
	return nil
}
