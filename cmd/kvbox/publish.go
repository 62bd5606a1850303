package main

// Published ports (kvbox new --publish) are held by a detached
// `kvbox port-forward --listen-fds` child per box: kvbox has no daemon, and
// a child that only holds one agent connection and the listening sockets is
// the smallest thing that can outlive the `new` command. `new` binds the
// sockets itself before it creates the box (a taken port fails the command
// with nothing created) and hands them to the child, which then only has
// to reach the agent. The child writes "ok" on a pipe once it carries
// traffic; a child that cannot reach the agent fails `new`, which removes
// the box. The child's pid, the ports and the box's UUID are in
// publish/NAME.json under the state dir, root's alone (and its log beside
// it): `ls --json` lists them, `rm` and `stop` end the child first, `start`
// binds the ports again. Not in the box's folder, which QEMU's user can
// write: a QEMU the box took over would choose what ports `start` binds
// and what root reads and follows. The child also ends on its own when the
// box's agent channel closes (QEMU gone: virsh destroy, a crash).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
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
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/statedir"
)

// legacyPublishFile is where an earlier kvbox kept the record: in the
// box's folder, which QEMU's user can write. It is read only to end a
// holder such a kvbox started (its pid is checked to be that holder's),
// never followed, never waited on, and its ports are never bound.
const legacyPublishFile = "publish.json"

// publishRecord is a box's publish/NAME.json.
type publishRecord struct {
	UUID  string     `json:"uuid"` // the box's: a record of an earlier box of the name is not this one's
	PID   int        `json:"pid"`
	Ports []portSpec `json:"ports"`
}

// maxPublishRecord bounds what is read of a record (a few ports' worth).
const maxPublishRecord = 64 << 10

// publishPath is box name's record (ext ".json") or its holder's log
// (".log"), root's alone.
func (a *app) publishPath(name, ext string) string {
	return filepath.Join(a.stateDir, "publish", name+ext)
}

// readPublish is box b's record; ok is false when it has none (or one of
// an earlier box of its name).
func (a *app) readPublish(b domain.Box) (r publishRecord, ok bool) {
	data, err := readBounded(a.publishPath(b.Name, ".json"), maxPublishRecord)
	if err != nil || json.Unmarshal(data, &r) != nil || r.UUID == "" || r.UUID != b.UUID {
		return publishRecord{}, false
	}
	return r, true
}

// legacyHolder is the pid of a live holder an earlier kvbox recorded in
// box b's folder, or 0.
func legacyHolder(b domain.Box) int {
	if b.Dir == "" {
		return 0
	}
	data, err := readBounded(filepath.Join(b.Dir, legacyPublishFile), maxPublishRecord)
	var r publishRecord
	if err != nil || json.Unmarshal(data, &r) != nil || !holderAlive(r.PID, b.Name) {
		return 0
	}
	return r.PID
}

// readBounded reads at most max bytes of path, a plain file it does not
// follow a link to nor wait on (domain.OpenNoFollow).
func readBounded(path string, max int64) ([]byte, error) {
	f, err := domain.OpenNoFollow(path, os.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, max))
}

// forgetPublish drops the record and log of a removed box.
func (a *app) forgetPublish(name string) {
	os.Remove(a.publishPath(name, ".json"))
	os.Remove(a.publishPath(name, ".log"))
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
func (a *app) publishedPorts(b domain.Box) []portSpec {
	r, ok := a.readPublish(b)
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
	if err := os.MkdirAll(filepath.Dir(a.publishPath(b.Name, "")), statedir.PrivateDirMode); err != nil {
		return err
	}
	logPath := a.publishPath(b.Name, ".log")
	logf, err := domain.OpenNoFollow(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND)
	if err != nil {
		return err
	}
	if err := logf.Chmod(0o600); err != nil {
		logf.Close()
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
			logged, _ := readBounded(logPath, 4<<10)
			why = strings.TrimSpace(string(bytes.TrimPrefix(logged, []byte("kvbox: "))))
		}
		if why == "" {
			why = "the port holder ended at once"
		}
		return fmt.Errorf("publish ports of box %q: %s", b.Name, why)
	}
	rec, _ := json.Marshal(publishRecord{UUID: b.UUID, PID: cmd.Process.Pid, Ports: specs})
	if err := overlay.WriteFileAtomic(a.publishPath(b.Name, ".json"), rec, 0o600); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return err
	}
	cmd.Process.Release()
	return nil
}

// stopPublish ends box b's port holder, if it has one, and waits until its
// sockets are closed.
func (a *app) stopPublish(b domain.Box) error {
	pid := 0
	if r, ok := a.readPublish(b); ok && holderAlive(r.PID, b.Name) {
		pid = r.PID
	} else {
		pid = legacyHolder(b)
	}
	if pid == 0 {
		return nil
	}
	unix.Kill(pid, unix.SIGTERM)
	deadline := time.Now().Add(3 * time.Second)
	for holderAlive(pid, b.Name) {
		if time.Now().After(deadline) {
			unix.Kill(pid, unix.SIGKILL)
		}
		if time.Now().After(deadline.Add(2 * time.Second)) {
			return fmt.Errorf("box %q: its port holder (pid %d) does not end", b.Name, pid)
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

func (a *app) withPublished(boxes []domain.Box) []boxJSON {
	out := make([]boxJSON, 0, len(boxes))
	for _, b := range boxes {
		out = append(out, boxJSON{Box: b, Published: a.publishedPorts(b)})
	}
	return out
}

// republish starts the holder of a box started again after stop with the
// ports it was created with.
func (a *app) republish(b domain.Box) error {
	r, ok := a.readPublish(b)
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
