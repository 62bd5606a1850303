package envd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/guest-agent/envd/spec/process"
	"kvbox.dev/kvbox/guest-agent/guestexec"
)

const (
	// chunkSize is the most output one data event carries.
	chunkSize = 32 << 10
	// subBuffer is how many events wait for a slow subscriber before the
	// process's output blocks on it.
	subBuffer = 16
)

// processes is the table of running processes.
type processes struct {
	mu    sync.Mutex
	byPID map[uint32]*proc
}

// proc is one process envd started. Its output goes to every subscriber
// (the stream that started it, those that connected since), and is
// dropped while it has none.
type proc struct {
	s   *Server
	pid uint32
	tag string
	cfg *process.ProcessConfig

	cmd    *exec.Cmd
	master *os.File // the pty, or nil
	outs   []*os.File
	exited guestexec.Drain
	// timedOut: the deadline of the call that started it killed it.
	timedOut atomic.Bool

	stdinMu sync.Mutex
	stdin   *os.File // the stdin pipe while open; the pty for a pty

	mu   sync.Mutex
	subs map[*subscriber]struct{}
	end  *process.ProcessEvent
}

type subscriber struct {
	ch   chan *process.ProcessEvent
	gone chan struct{} // closed when the subscriber leaves
}

type processService struct{ s *Server }

func (ps *processService) List(ctx context.Context, _ *connect.Request[process.ListRequest]) (*connect.Response[process.ListResponse], error) {
	s := ps.s
	s.procs.mu.Lock()
	var l []*process.ProcessInfo
	for _, p := range s.procs.byPID {
		info := &process.ProcessInfo{Config: p.cfg, Pid: p.pid}
		if p.tag != "" {
			info.Tag = &p.tag
		}
		l = append(l, info)
	}
	s.procs.mu.Unlock()
	sort.Slice(l, func(i, j int) bool { return l[i].Pid < l[j].Pid })
	return connect.NewResponse(&process.ListResponse{Processes: l}), nil
}

func (ps *processService) Start(ctx context.Context, req *connect.Request[process.StartRequest], stream *connect.ServerStream[process.StartResponse]) error {
	s := ps.s
	m := req.Msg
	if m.Process == nil || m.Process.Cmd == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("start: no command (process.cmd)"))
	}
	u, err := s.userFromHeader(req.Header())
	if err != nil {
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	p, sub, err := s.start(ctx, m, u)
	if err != nil {
		return err
	}
	return p.follow(ctx, sub, true, keepaliveInterval(req.Header()), func(ev *process.ProcessEvent) error {
		return stream.Send(&process.StartResponse{Event: ev})
	})
}

func (ps *processService) Connect(ctx context.Context, req *connect.Request[process.ConnectRequest], stream *connect.ServerStream[process.ConnectResponse]) error {
	p, err := ps.s.find(req.Msg.Process)
	if err != nil {
		return err
	}
	sub := p.subscribe()
	return p.follow(ctx, sub, false, keepaliveInterval(req.Header()), func(ev *process.ProcessEvent) error {
		return stream.Send(&process.ConnectResponse{Event: ev})
	})
}

func (ps *processService) Update(ctx context.Context, req *connect.Request[process.UpdateRequest]) (*connect.Response[process.UpdateResponse], error) {
	p, err := ps.s.find(req.Msg.Process)
	if err != nil {
		return nil, err
	}
	if size := req.Msg.Pty.GetSize(); size != nil {
		if p.master == nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has no terminal to resize", p.pid))
		}
		if err := guestexec.SetWinsize(p.master, uint16(size.Rows), uint16(size.Cols)); err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("resize the terminal of process %d: %w", p.pid, err))
		}
	}
	return connect.NewResponse(&process.UpdateResponse{}), nil
}

func (ps *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[process.StreamInputRequest]) (*connect.Response[process.StreamInputResponse], error) {
	var p *proc
	for stream.Receive() {
		switch ev := stream.Msg().Event.(type) {
		case *process.StreamInputRequest_Start:
			var err error
			if p, err = ps.s.find(ev.Start.GetProcess()); err != nil {
				return nil, err
			}
		case *process.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("stream input: data before the start event that names the process"))
			}
			if err := p.input(ev.Data.GetInput()); err != nil {
				return nil, err
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.StreamInputResponse{}), nil
}

func (ps *processService) SendInput(ctx context.Context, req *connect.Request[process.SendInputRequest]) (*connect.Response[process.SendInputResponse], error) {
	p, err := ps.s.find(req.Msg.Process)
	if err != nil {
		return nil, err
	}
	if err := p.input(req.Msg.Input); err != nil {
		return nil, err
	}
	return connect.NewResponse(&process.SendInputResponse{}), nil
}

func (ps *processService) SendSignal(ctx context.Context, req *connect.Request[process.SendSignalRequest]) (*connect.Response[process.SendSignalResponse], error) {
	p, err := ps.s.find(req.Msg.Process)
	if err != nil {
		return nil, err
	}
	var sig unix.Signal
	switch req.Msg.Signal {
	case process.Signal_SIGNAL_SIGKILL:
		sig = unix.SIGKILL
	case process.Signal_SIGNAL_SIGTERM:
		sig = unix.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("signal %v: only SIGNAL_SIGTERM and SIGNAL_SIGKILL are sent", req.Msg.Signal))
	}
	p.kill(sig)
	return connect.NewResponse(&process.SendSignalResponse{}), nil
}

func (ps *processService) CloseStdin(ctx context.Context, req *connect.Request[process.CloseStdinRequest]) (*connect.Response[process.CloseStdinResponse], error) {
	p, err := ps.s.find(req.Msg.Process)
	if err != nil {
		return nil, err
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	switch {
	case p.master != nil:
		// A terminal has no half-close: the EOF character ends its input.
		p.master.Write([]byte{4})
	case p.stdin != nil:
		p.stdin.Close()
		p.stdin = nil
	}
	return connect.NewResponse(&process.CloseStdinResponse{}), nil
}

// find resolves a selector to a running process.
func (s *Server) find(sel *process.ProcessSelector) (*proc, error) {
	s.procs.mu.Lock()
	defer s.procs.mu.Unlock()
	switch x := sel.GetSelector().(type) {
	case *process.ProcessSelector_Pid:
		if p := s.procs.byPID[x.Pid]; p != nil {
			return p, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", x.Pid))
	case *process.ProcessSelector_Tag:
		for _, p := range s.procs.byPID {
			if p.tag == x.Tag {
				return p, nil
			}
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %q not found", x.Tag))
	}
	return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("no process selected (pid or tag)"))
}

// start starts the process of m as u, with the stream that asked for it
// subscribed before any output is read.
func (s *Server) start(ctx context.Context, m *process.StartRequest, u *guestexec.User) (*proc, *subscriber, error) {
	cmd, err := s.command(m, u)
	if err != nil {
		return nil, nil, err
	}
	p := &proc{s: s, tag: m.GetTag(), cfg: m.Process, cmd: cmd, subs: map[*subscriber]struct{}{}}
	stdio, childEnds, err := guestexec.Wire(cmd, m.Pty != nil, uint16(m.Pty.GetSize().GetRows()), uint16(m.Pty.GetSize().GetCols()), m.GetStdin())
	if err != nil {
		return nil, nil, connect.NewError(connect.CodeInternal, err)
	}
	defer childEnds.Close()
	p.master, p.stdin, p.outs = stdio.PTY, stdio.Stdin, stdio.Outs
	if err := runAs(cmd, u); err != nil {
		stdio.Close()
		return nil, nil, err
	}
	sub := p.subscribe()
	startFn := cmd.Start
	if s.opts.StartProcess != nil {
		startFn = func() error { return s.opts.StartProcess(cmd.Start) }
	}
	if err := startFn(); err != nil {
		stdio.Close()
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("start %s as %s in %s: %w", cmd.Path, u.Name, cmd.Dir, err))
	}
	p.pid = uint32(cmd.Process.Pid)
	s.procs.mu.Lock()
	if s.procs.byPID == nil {
		s.procs.byPID = map[uint32]*proc{}
	}
	s.procs.byPID[p.pid] = p
	s.procs.mu.Unlock()
	go p.run(p.deadline(ctx))
	return p, sub, nil
}

// command is m's command as u: its working directory (m's, else the
// configured default, else u's home), its binary found in its PATH, and
// its tag not taken by a running process.
func (s *Server) command(m *process.StartRequest, u *guestexec.User) (*exec.Cmd, error) {
	cfg := s.Config()
	env := processEnv(cfg, u, m.Process.Envs)
	dir := m.Process.GetCwd()
	if dir == "" {
		dir = cfg.DefaultWorkdir
	}
	if dir == "" {
		dir = u.Home
	} else {
		var err error
		if dir, err = resolvePath(dir, u); err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, err)
		}
	}
	if err := guestexec.CheckWorkdir(dir); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	pathEnv := ""
	for _, kv := range env {
		if len(kv) > 5 && kv[:5] == "PATH=" {
			pathEnv = kv[5:]
		}
	}
	bin, err := guestexec.LookPath(m.Process.Cmd, pathEnv)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	if tag := m.GetTag(); tag != "" {
		if _, err := s.find(&process.ProcessSelector{Selector: &process.ProcessSelector_Tag{Tag: tag}}); err == nil {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("a process with tag %q is running", tag))
		}
	}
	return &exec.Cmd{Path: bin, Args: append([]string{m.Process.Cmd}, m.Process.Args...), Env: env, Dir: dir}, nil
}

// runAs makes cmd run as u: envd as root takes on u's ids, envd as
// another user starts processes only as itself.
func runAs(cmd *exec.Cmd, u *guestexec.User) error {
	if os.Geteuid() == 0 {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: u.Groups}
	} else if u.UID != uint32(os.Geteuid()) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("envd runs as uid %d and cannot start processes as user %s", os.Geteuid(), u.Name))
	}
	return nil
}

// deadline kills the process at the deadline of the call that started it:
// Connect-Timeout-Ms bounds the process's life, not only the stream's; the
// process outlives a client that goes away, not its deadline. nil: none.
func (p *proc) deadline(ctx context.Context) *time.Timer {
	dl, ok := ctx.Deadline()
	if !ok {
		return nil
	}
	return time.AfterFunc(time.Until(dl), func() {
		p.timedOut.Store(true)
		p.kill(unix.SIGKILL)
	})
}

func (p *proc) subscribe() *subscriber {
	sub := &subscriber{ch: make(chan *process.ProcessEvent, subBuffer), gone: make(chan struct{})}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		sub.ch <- p.end
		return sub
	}
	p.subs[sub] = struct{}{}
	return sub
}

func (p *proc) leave(sub *subscriber) {
	p.mu.Lock()
	delete(p.subs, sub)
	p.mu.Unlock()
	close(sub.gone)
}

// broadcast hands ev to every subscriber; a slow one holds the process's
// output back (as a pipe would), one that left does not.
func (p *proc) broadcast(ev *process.ProcessEvent, end bool) {
	p.mu.Lock()
	if end {
		p.end = ev
	}
	subs := make([]*subscriber, 0, len(p.subs))
	for sub := range p.subs {
		subs = append(subs, sub)
	}
	p.mu.Unlock()
	for _, sub := range subs {
		select {
		case sub.ch <- ev:
		case <-sub.gone:
		}
	}
}

// errTimedOut ends the stream of a call whose deadline killed its process.
var errTimedOut = connect.NewError(connect.CodeDeadlineExceeded, errors.New("the call's timeout (Connect-Timeout-Ms) passed: the process was killed"))

// follow streams a process to one subscriber: its start event, its events,
// and keepalives when the stream is idle for interval, until the end event
// or until the client goes (the process runs on). The stream of the call
// that started the process (starter) ends with its deadline when that
// killed the process, whichever of the two the stream sees first.
func (p *proc) follow(ctx context.Context, sub *subscriber, starter bool, interval time.Duration, send func(*process.ProcessEvent) error) error {
	defer p.leave(sub)
	if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Start{Start: &process.ProcessEvent_StartEvent{Pid: p.pid}}}); err != nil {
		return err
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case ev := <-sub.ch:
			if ev.GetEnd() != nil && starter && p.timedOut.Load() {
				return errTimedOut
			}
			if err := send(ev); err != nil {
				return err
			}
			if ev.GetEnd() != nil {
				return nil
			}
			t.Reset(interval)
		case <-t.C:
			if err := send(&process.ProcessEvent{Event: &process.ProcessEvent_Keepalive{Keepalive: &process.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				if starter {
					return errTimedOut
				}
				return connect.NewError(connect.CodeDeadlineExceeded, errors.New("the call's timeout (Connect-Timeout-Ms) passed; the process runs on"))
			}
			return ctx.Err()
		}
	}
}

// run moves the output to the subscribers, then sends the end event and
// forgets the process.
func (p *proc) run(timer *time.Timer) {
	var pumps sync.WaitGroup
	for i, f := range p.outs {
		pumps.Add(1)
		go func() {
			defer pumps.Done()
			p.pump(f, i)
		}()
	}
	err := p.cmd.Wait()
	if timer != nil {
		timer.Stop()
	}
	p.exited.Exited()
	for _, f := range p.outs {
		f.SetReadDeadline(p.exited.Deadline())
	}
	pumps.Wait()
	for _, f := range p.outs {
		f.Close()
	}
	p.stdinMu.Lock()
	if p.stdin != nil && p.stdin != p.master {
		p.stdin.Close()
	}
	p.stdin = nil
	p.stdinMu.Unlock()

	end := &process.ProcessEvent_EndEvent{}
	if ps := p.cmd.ProcessState; ps != nil {
		end.ExitCode = int32(ps.ExitCode())
		end.Exited = ps.Exited()
		end.Status = ps.String()
	}
	var exitErr *exec.ExitError
	if err != nil && !errors.As(err, &exitErr) {
		msg := err.Error()
		end.Error = &msg
	}
	p.s.procs.mu.Lock()
	delete(p.s.procs.byPID, p.pid)
	p.s.procs.mu.Unlock()
	p.broadcast(&process.ProcessEvent{Event: &process.ProcessEvent_End{End: end}}, true)
}

// pump reads one output (0 stdout, 1 stderr, or the pty) into data events.
func (p *proc) pump(f *os.File, i int) {
	p.exited.Pump(f, chunkSize, func(b []byte) bool {
		b = append([]byte(nil), b...)
		data := &process.ProcessEvent_DataEvent{}
		switch {
		case p.master != nil:
			data.Output = &process.ProcessEvent_DataEvent_Pty{Pty: b}
		case i == 0:
			data.Output = &process.ProcessEvent_DataEvent_Stdout{Stdout: b}
		default:
			data.Output = &process.ProcessEvent_DataEvent_Stderr{Stderr: b}
		}
		p.broadcast(&process.ProcessEvent{Event: &process.ProcessEvent_Data{Data: data}}, false)
		return true
	})
}

// input writes to the process's stdin or terminal.
func (p *proc) input(in *process.ProcessInput) error {
	var b []byte
	switch x := in.GetInput().(type) {
	case *process.ProcessInput_Stdin:
		b = x.Stdin
	case *process.ProcessInput_Pty:
		if p.master == nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has no terminal (start it with pty)", p.pid))
		}
		b = x.Pty
	default:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("no input (stdin or pty)"))
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("the stdin of process %d is closed (start it with stdin: true to send input)", p.pid))
	}
	if _, err := p.stdin.Write(b); err != nil {
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("write to process %d: %w", p.pid, err))
	}
	return nil
}

// kill signals the process's whole group (a pty's session leader leads
// its group too).
func (p *proc) kill(sig unix.Signal) {
	if p.exited.Done() {
		return // reaped: the group id may be someone else's now
	}
	if err := unix.Kill(-int(p.pid), sig); err != nil && !errors.Is(err, unix.ESRCH) {
		p.s.logf("signal process %d: %v", p.pid, err)
	}
}
