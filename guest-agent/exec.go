package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/guest-agent/guestexec"
)

const (
	defaultPath = guestexec.DefaultPath
	defaultTerm = "xterm-256color"
	// stdinWindow is how many stdin frames the host may send before the
	// guest acknowledges one; it bounds what the guest buffers.
	stdinWindow = 16
)

func init() { registerOp(methodExec, authorizedOnly, (*session).exec) }

// exec starts the command of an exec request, one at a time on a
// connection: its stdin, resizes and signals come as frames with its
// request's id, its output and exit go out from goroutines of its own.
func (ss *session) exec(gen uint64, id uint32, params json.RawMessage) {
	var er ExecRequest
	if err := json.Unmarshal(params, &er); err != nil {
		ss.reply(gen, id, nil, fmt.Errorf("bad exec request: %v", err))
		return
	}
	ss.mu.Lock()
	busy := ss.proc != nil
	ss.mu.Unlock()
	if busy {
		ss.reply(gen, id, nil, errors.New("an exec is already running on this connection"))
		return
	}
	p, err := startProcess(ss, gen, id, er)
	if err != nil {
		ss.reply(gen, id, nil, err)
		return
	}
	ss.mu.Lock()
	ss.proc = p
	ss.mu.Unlock()
	ss.reply(gen, id, nil, nil)
	p.run()
}

// process is one running exec in a session.
type process struct {
	ss    *session
	gen   uint64
	id    uint32
	argv0 string
	tty   bool

	cmd    *exec.Cmd
	pid    int
	outs   []*os.File // stdout, stderr pipes or the pty master
	stdinW *os.File   // stdin pipe or the pty master
	master *os.File
	queue  chan frame // stdin frames, bounded by stdinWindow
	qmu    sync.Mutex
	qdone  bool // queue closed
	exited guestexec.Drain
}

func envLookup(env []string, key string) string {
	for i := len(env) - 1; i >= 0; i-- {
		if k, v, ok := strings.Cut(env[i], "="); ok && k == key {
			return v
		}
	}
	return ""
}

// execEnv returns the environment of req: the given one, or defaults
// (with u's HOME, USER and LOGNAME when u is set), then EnvAdd on top.
func execEnv(req ExecRequest, u *guestexec.User) []string {
	env := req.Env
	if len(env) == 0 {
		env = DefaultEnv(req.TTY, "")
		if u != nil {
			env = MergeEnv(env, []string{"HOME=" + u.Home, "USER=" + u.Name, "LOGNAME=" + u.Name})
		}
	}
	return MergeEnv(env, req.EnvAdd)
}

// MergeEnv returns env with add applied: a variable of the same name is
// replaced in place, a new one appended.
func MergeEnv(env, add []string) []string {
	out := append([]string(nil), env...)
	for _, kv := range add {
		k, _, _ := strings.Cut(kv, "=")
		replaced := false
		for i, old := range out {
			if ok, _, _ := strings.Cut(old, "="); ok == k {
				out[i], replaced = kv, true
			}
		}
		if !replaced {
			out = append(out, kv)
		}
	}
	return out
}

// DefaultEnv is the environment a command gets when its request names
// none: PATH and HOME, and TERM (term, or xterm-256color) on a terminal. A
// request that sets its own environment replaces this one, so a client
// that only wants to add a variable starts from DefaultEnv.
func DefaultEnv(tty bool, term string) []string {
	env := []string{"PATH=" + defaultPath, "HOME=/root"}
	if tty {
		if term == "" {
			term = defaultTerm
		}
		env = append(env, "TERM="+term)
	}
	return env
}

// resolveExec checks an exec request and works out who runs what where:
// the user (nil: the agent's), the environment, the program and the
// working directory.
func resolveExec(req ExecRequest) (u *guestexec.User, env []string, bin, dir string, err error) {
	if len(req.Argv) == 0 || req.Argv[0] == "" {
		return nil, nil, "", "", errors.New("exec: empty argv")
	}
	if req.User != "" {
		if u, err = guestexec.LookupUser(req.User); err != nil {
			return nil, nil, "", "", err
		}
	}
	for _, kv := range req.EnvAdd {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return nil, nil, "", "", fmt.Errorf("env %q: not NAME=VALUE", kv)
		}
	}
	env = execEnv(req, u)
	dir = req.Dir
	if dir != "" {
		if err := guestexec.CheckWorkdir(dir); err != nil {
			return nil, nil, "", "", err
		}
	}
	bin, err = guestexec.LookPath(req.Argv[0], envLookup(env, "PATH"))
	if req.Argv[0] == selfArgv0 {
		bin, err = os.Executable() // the file helper (files.go)
	}
	if err != nil {
		return nil, nil, "", "", err
	}
	if dir == "" {
		dir = envLookup(env, "HOME")
		if st, err := os.Stat(dir); dir == "" || err != nil || !st.IsDir() {
			dir = "/"
		}
	}
	return u, env, bin, dir, nil
}

func startProcess(ss *session, gen uint64, id uint32, req ExecRequest) (*process, error) {
	u, env, bin, dir, err := resolveExec(req)
	if err != nil {
		return nil, err
	}
	cmd := &exec.Cmd{Path: bin, Args: req.Argv, Env: env, Dir: dir}
	p := &process{ss: ss, gen: gen, id: id, argv0: req.Argv[0], tty: req.TTY, cmd: cmd,
		queue: make(chan frame, stdinWindow+1)}

	stdio, childEnds, err := guestexec.Wire(cmd, req.TTY, req.Rows, req.Cols, true)
	if err != nil {
		return nil, err
	}
	defer childEnds.Close()
	p.master, p.stdinW, p.outs = stdio.PTY, stdio.Stdin, stdio.Outs
	if u != nil {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: u.Groups}
	}
	if err := ss.srv.boosts.unboosted(cmd.Start); err != nil {
		p.closeAll()
		if u != nil && errors.Is(err, os.ErrPermission) {
			return nil, fmt.Errorf("user %s: may not run %s in %s: %w", req.User, bin, dir, err)
		}
		return nil, err
	}
	p.pid = cmd.Process.Pid
	return p, nil
}

func (p *process) closeAll() {
	guestexec.Stdio{Stdin: p.stdinW, Outs: p.outs}.Close()
}

// run starts the goroutines that move data and report the exit.
func (p *process) run() {
	var pumps sync.WaitGroup
	types := []frameType{frameStdout, frameStderr}
	for i, f := range p.outs {
		pumps.Add(1)
		go func() {
			defer pumps.Done()
			p.pump(f, types[i])
		}()
	}
	go p.stdinLoop()
	go func() {
		err := p.cmd.Wait()
		p.exited.Exited()
		for _, f := range p.outs {
			f.SetReadDeadline(p.exited.Deadline())
		}
		pumps.Wait()
		p.closeAll()
		p.qmu.Lock()
		p.qdone = true
		close(p.queue)
		p.qmu.Unlock()
		st := exitStatus{Code: exitCode(p.cmd.ProcessState, err)}
		p.ss.finished(p)
		if err := p.ss.sendJSON(p.gen, frameExit, p.id, st); err != nil && !errors.Is(err, errStale) {
			p.ss.srv.logf("%s: exec %q exit: %v", p.ss.name, p.argv0, err)
		}
	}()
}

func exitCode(ps *os.ProcessState, err error) int {
	if ps == nil {
		return 255
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ps.ExitCode()
}

// pump copies one output stream into frames. Writing a frame blocks while
// the host does not read, which blocks the process: no unbounded buffering.
func (p *process) pump(f *os.File, t frameType) {
	p.exited.Pump(f, chunkSize, func(b []byte) bool {
		if err := p.ss.send(p.gen, t, p.id, b); err != nil {
			// The host is gone or another one took over: stop
			// reading, the process gets EPIPE or the abort's kill.
			f.Close()
			return false
		}
		return true
	})
}

// stdin queues one host frame; the host keeps at most stdinWindow in
// flight, so the queue never blocks the session's reader.
func (p *process) stdin(f frame) {
	p.qmu.Lock()
	defer p.qmu.Unlock()
	if p.qdone {
		return
	}
	select {
	case p.queue <- f:
	default:
		p.ss.srv.logf("%s: exec %q: host overran the stdin window, dropping", p.ss.name, p.argv0)
	}
}

func (p *process) stdinLoop() {
	eof := false
	for f := range p.queue {
		switch {
		case eof:
		case f.Type == frameStdinEOF:
			eof = true
			if p.tty {
				// A pty has no half-close: send the EOF character.
				p.stdinW.Write([]byte{4})
			} else {
				p.stdinW.Close()
			}
			continue
		default:
			if _, err := p.stdinW.Write(f.Payload); err != nil && !errors.Is(err, os.ErrClosed) && !errors.Is(err, syscall.EPIPE) {
				p.ss.srv.logf("%s: exec %q stdin: %v", p.ss.name, p.argv0, err)
			}
		}
		if f.Type == frameStdin {
			p.ss.send(p.gen, frameStdinAck, p.id, nil)
		}
	}
}

func (p *process) resize(ws WinSize) {
	if p.master == nil || ws.Rows == 0 || ws.Cols == 0 {
		return
	}
	guestexec.SetWinsize(p.master, ws.Rows, ws.Cols)
}

// kill signals the whole process group (a pty session leader's pid is its
// group id too).
func (p *process) kill(sig unix.Signal) {
	if p.exited.Done() {
		return // reaped: the group id may belong to someone else now
	}
	if err := unix.Kill(-p.pid, sig); err != nil && !errors.Is(err, unix.ESRCH) {
		p.ss.srv.logf("%s: kill exec %q: %v", p.ss.name, p.argv0, err)
	}
}
