package guestexec

import (
	"os"
	"os/exec"
	"syscall"
)

// Stdio is the agent's side of a command's standard streams.
type Stdio struct {
	PTY   *os.File   // the pseudo-terminal's master, or nil
	Stdin *os.File   // where the command's stdin is written (the master for a pty); nil: it reads /dev/null
	Outs  []*os.File // where its stdout and stderr are read (the master alone for a pty)
}

// Close closes the agent's side, for a command that did not start.
func (s Stdio) Close() {
	for _, f := range s.Outs {
		f.Close()
	}
	if s.Stdin != nil {
		s.Stdin.Close()
	}
}

// ChildEnds are the command's ends of its standard streams, which the
// agent closes once the command has started or failed to.
type ChildEnds []*os.File

// Close closes them.
func (c ChildEnds) Close() {
	for _, f := range c {
		f.Close()
	}
}

// Wire gives cmd its standard streams: a pseudo-terminal of rows by cols
// that is its session's controlling terminal (tty), else pipes (a pipe
// for its stdin too when stdin), the command in a process group of its
// own: a signal, a timeout or an abort reaches its children, and the
// agent's priority changes (one call for its group) do not reach it. On
// error nothing is left open.
func Wire(cmd *exec.Cmd, tty bool, rows, cols uint16, stdin bool) (Stdio, ChildEnds, error) {
	if tty {
		master, slave, err := OpenPTY()
		if err != nil {
			return Stdio{}, nil, err
		}
		SetWinsize(slave, rows, cols)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
		return Stdio{PTY: master, Stdin: master, Outs: []*os.File{master}}, ChildEnds{slave}, nil
	}
	var s Stdio
	var childEnds ChildEnds
	fail := func(err error) (Stdio, ChildEnds, error) {
		s.Close()
		childEnds.Close()
		return Stdio{}, nil, err
	}
	for i := range 2 {
		r, w, err := os.Pipe()
		if err != nil {
			return fail(err)
		}
		childEnds = append(childEnds, w)
		s.Outs = append(s.Outs, r)
		if i == 0 {
			cmd.Stdout = w
		} else {
			cmd.Stderr = w
		}
	}
	if stdin {
		r, w, err := os.Pipe()
		if err != nil {
			return fail(err)
		}
		childEnds = append(childEnds, r)
		cmd.Stdin, s.Stdin = r, w
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return s, childEnds, nil
}
