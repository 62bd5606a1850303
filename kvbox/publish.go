package kvbox

// Published ports (Publish; kvbox new --publish) are held by a detached port
// holder per box (Config.HolderCommand; the CLI's is `kvbox port-forward
// --listen-fds`): kvbox has no daemon, and a child that only holds one
// agent connection and the listening sockets is the smallest thing that can
// outlive the command that made the box. The listeners are bound before the
// box exists (a taken port creates nothing) and handed to the holder, which
// then only has to reach the agent. The holder writes "ok" on a pipe once
// it carries traffic; a holder that cannot reach the agent fails the
// creation, which removes the box. The holder's pid, the ports and the
// box's UUID are in publish/NAME.json under the state dir, root's alone
// (and its log beside it): Boxes lists them, Remove and Stop end the holder
// first, Start binds the ports again. Not in the box's folder, which
// QEMU's user can write: a QEMU the box took over would choose what ports
// Start binds and what root reads and follows. The holder also ends on its
// own when the box's agent channel closes (QEMU gone: virsh destroy, a
// crash).

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/statedir"
)

// publishRecord is a box's publish/NAME.json.
type publishRecord struct {
	UUID  string `json:"uuid"` // the box's: a record of an earlier box of the name is not this one's
	PID   int    `json:"pid"`
	Ports []Port `json:"ports"`
}

// maxPublishRecord bounds what is read of a record (a few ports' worth).
const maxPublishRecord = 64 << 10

// HolderArg is the flag on a port holder's command line: with the box's
// name there, it tells kvbox's holder of that box from any other process.
const HolderArg = "--listen-fds"

// readPublish is box b's record; ok is false when it has none (or one of
// an earlier box of its name).
func (h *Host) readPublish(b domain.Box) (r publishRecord, ok bool) {
	data, err := readBounded(h.layout.Publish(b.Name, ".json"), maxPublishRecord)
	if err != nil || json.Unmarshal(data, &r) != nil || r.UUID == "" || r.UUID != b.UUID {
		return publishRecord{}, false
	}
	return r, true
}

// forgetPublish drops the record and log of a removed box.
func (h *Host) forgetPublish(name string) {
	os.Remove(h.layout.Publish(name, ".json"))
	os.Remove(h.layout.Publish(name, ".log"))
}

// holderAlive reports whether pid is the port holder of box name.
func holderAlive(pid int, name string) bool {
	hasFwd, hasName := false, false
	for _, a := range cmdline(pid) {
		hasFwd = hasFwd || a == HolderArg
		hasName = hasName || a == name
	}
	return hasFwd && hasName
}

// publishedPorts are the ports of box b's live holder.
func (h *Host) publishedPorts(b domain.Box) []Port {
	r, ok := h.readPublish(b)
	if !ok || !holderAlive(r.PID, b.Name) {
		return nil
	}
	return r.Ports
}

// startPublish hands the bound listeners to a detached holder that
// forwards them to box b until it stops or is removed, and waits until it
// runs.
func (h *Host) startPublish(b domain.Box, ports []Port, ls []*net.TCPListener) error {
	if h.cfg.HolderCommand == nil {
		return base.Errorf(base.Invalid, "publish ports of box %q: this kvbox runs no port holders", b.Name)
	}
	files, err := listenerFiles(ls)
	defer closeFiles(files)
	if err != nil {
		return err
	}
	rp, wp, err := os.Pipe()
	if err != nil {
		return err
	}
	defer rp.Close()
	files = append(files, wp)
	logf, err := h.holderLog(b.Name)
	if err != nil {
		return err
	}
	files = append(files, logf)
	cmd := h.cfg.HolderCommand(b.Name, ports, 3+len(ls))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = files[:len(ls)+1]
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the port holder: %w", err)
	}
	wp.Close() // the child holds it now: its exit ends our read
	if why := h.holderReady(rp, b.Name); why != "" {
		cmd.Process.Kill()
		cmd.Wait()
		return fmt.Errorf("publish ports of box %q: %s", b.Name, why)
	}
	rec, _ := json.Marshal(publishRecord{UUID: b.UUID, PID: cmd.Process.Pid, Ports: ports})
	if err := overlay.WriteFileAtomic(h.layout.Publish(b.Name, ".json"), rec, 0o600); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return err
	}
	return cmd.Process.Release()
}

// holderLog opens the log of box name's holder, root's alone.
func (h *Host) holderLog(name string) (*os.File, error) {
	path := h.layout.Publish(name, ".log")
	if err := os.MkdirAll(filepath.Dir(path), statedir.PrivateDirMode); err != nil {
		return nil, err
	}
	f, err := domain.OpenNoFollow(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND)
	if err != nil {
		return nil, err
	}
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// holderReady waits for the holder's word on r: "" once it forwards, else
// why it does not.
func (h *Host) holderReady(r *os.File, name string) string {
	done := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(r).ReadString('\n')
		done <- strings.TrimSpace(line)
	}()
	var line string
	select {
	case line = <-done:
	case <-time.After(h.cfg.DialTimeout + 5*time.Second):
		line = "no answer"
	}
	if line == "ok" {
		return ""
	}
	why, ok := strings.CutPrefix(line, "error: ")
	if !ok {
		logged, _ := readBounded(h.layout.Publish(name, ".log"), 4<<10)
		why = strings.TrimSpace(string(bytes.TrimPrefix(logged, []byte("kvbox: "))))
	}
	if why == "" {
		why = "the port holder ended at once"
	}
	return why
}

// SignalReady is the port holder's word to the command that started it,
// on fd (none when 0): "ok" once it forwards (err nil), else why not
// (holderReady reads it).
func SignalReady(fd int, err error) {
	if fd <= 0 {
		return
	}
	f := os.NewFile(uintptr(fd), "ready")
	defer f.Close()
	if err != nil {
		fmt.Fprintf(f, "error: %s\n", err.Error())
		return
	}
	fmt.Fprintln(f, "ok")
}

func listenerFiles(ls []*net.TCPListener) ([]*os.File, error) {
	var files []*os.File
	for _, l := range ls {
		f, err := l.File()
		if err != nil {
			return files, err
		}
		files = append(files, f)
	}
	return files, nil
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

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// stopPublish ends box b's port holder, if it has one, and waits until its
// sockets are closed.
func (h *Host) stopPublish(b domain.Box) error {
	r, ok := h.readPublish(b)
	if !ok || !holderAlive(r.PID, b.Name) {
		return nil
	}
	pid := r.PID
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

// republish starts the holder of a box started again after a stop, with
// the ports it was created with; it returns them (none when the box has no
// record, or its holder runs).
func (h *Host) republish(b domain.Box) ([]Port, error) {
	r, ok := h.readPublish(b)
	if !ok || len(r.Ports) == 0 || holderAlive(r.PID, b.Name) {
		return nil, nil
	}
	ls, err := Listen(r.Ports)
	if err != nil {
		return nil, fmt.Errorf("box %s is running, but not its published ports: %w", b.Name, err)
	}
	defer closeAll(ls)
	if err := h.startPublish(b, r.Ports, ls); err != nil {
		return nil, fmt.Errorf("box %s is running, but not its published ports: %w", b.Name, err)
	}
	return r.Ports, nil
}
