package kvbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
)

// A box's streams (Dial, Connect, ServePorts) share one agent connection
// that carries them all (agent.Forwarder), opened on first use and kept
// while the Host lives: closed when the box is stopped, suspended or
// removed through this Host, and dropped when the agent connection ends.

// sharedForwarder is a box's forwarder, or the error of opening it.
type sharedForwarder struct {
	ready chan struct{} // closed once f or err is set
	f     *agent.Forwarder
	err   error
}

func (s *sharedForwarder) close() {
	<-s.ready
	if s.f != nil {
		s.f.Close()
	}
}

// forwarder is box name's shared forwarder, opened if it has none (or its
// last one ended).
func (h *Host) forwarder(ctx context.Context, name string) (*agent.Forwarder, error) {
	h.fwdMu.Lock()
	s := h.fwds[name]
	if s != nil {
		select {
		case <-s.ready:
			if s.err != nil || isDone(s.f) {
				s = nil
			}
		default:
		}
	}
	if s == nil {
		s = &sharedForwarder{ready: make(chan struct{})}
		h.fwds[name] = s
		h.fwdMu.Unlock()
		s.f, s.err = h.openForwarder(ctx, name)
		close(s.ready)
	} else {
		h.fwdMu.Unlock()
	}
	<-s.ready
	return s.f, s.err
}

func isDone(f *agent.Forwarder) bool {
	select {
	case <-f.Done():
		return true
	default:
		return false
	}
}

// dropForwarder closes box name's shared forwarder, if it has one.
func (h *Host) dropForwarder(name string) {
	h.fwdMu.Lock()
	s := h.fwds[name]
	delete(h.fwds, name)
	h.fwdMu.Unlock()
	if s != nil {
		s.close()
	}
}

// openForwarder reaches box name's agent and makes its connection a
// stream carrier.
func (h *Host) openForwarder(ctx context.Context, name string) (*agent.Forwarder, error) {
	b, client, err := h.dialBox(ctx, name)
	if err != nil {
		return nil, err
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.cfg.DialTimeout)
	defer cancel()
	f, err := client.Forward(dctx)
	if err != nil {
		client.Close()
		if errors.Is(err, agent.ErrNoForward) {
			return nil, base.Errorf(base.Unavailable, "box %q: %v", name, err)
		}
		return nil, fmt.Errorf("box %q: %w", name, err)
	}
	// A connection the guest never answers ends, and with it its
	// goroutine and socket (a port holder lives as long as the box).
	f.DialDeadline = h.cfg.DialTimeout
	// A snapshot of the box changes its agent token, which ends this
	// connection's rights: the forwarder presents the new one.
	f.Tokens = func() [][]byte { return domain.AgentTokens(b.Dir) }
	return f, nil
}

// Dial opens a stream to target in box name through its agent (no network
// route to the box is needed): "127.0.0.1:PORT" (or "PORT") in the guest,
// or "envd", the agent's own envd (agent.EnvdDialAddress). The stream is
// half-closed as TCP is (CloseWrite). A box's agent connection that ended
// since its last stream (its QEMU stopped and started again, a resume) is
// made again, once.
func (h *Host) Dial(ctx context.Context, name, target string) (net.Conn, error) {
	for try := 0; ; try++ {
		f, err := h.forwarder(ctx, name)
		if err != nil {
			return nil, err
		}
		mine, theirs, err := agent.SocketPair()
		if err != nil {
			return nil, err
		}
		if _, err := f.Connect(ctx, target, theirs); err != nil {
			mine.Close()
			theirs.Close()
			if try == 0 && isDone(f) {
				continue
			}
			return nil, fmt.Errorf("box %q %s: %w", name, target, err)
		}
		return mine, nil
	}
}

// Connect joins conn to a stream to target in box name (as Dial) until
// the stream ends either way, ctx ends (nil), or the box goes (its error:
// stopped, removed).
func (h *Host) Connect(ctx context.Context, name, target string, conn io.ReadWriteCloser) error {
	f, err := h.forwarder(ctx, name)
	if err != nil {
		return err
	}
	ended, err := f.Connect(ctx, target, conn)
	if err != nil {
		return fmt.Errorf("box %q %s: %s", name, target, RemoteMessage(err))
	}
	select {
	case <-ended:
		return nil
	case <-ctx.Done():
		return nil
	case <-f.Done():
		return h.boxGone(name, f)
	}
}

// ServePorts accepts on every listener and carries each connection to its
// port's guest port in box name, until ctx ends (nil) or the box's agent
// connection ends (why: the box stopped or was removed). ready, if set, is
// told once whether forwarding runs; refused, if set, of each connection
// the guest refused (it is closed). kvbox port-forward and a port holder
// are this.
func (h *Host) ServePorts(ctx context.Context, name string, ports []Port, ls []*net.TCPListener, ready func(error), refused func(Port, error)) error {
	f, err := h.forwarder(ctx, name)
	if ready != nil {
		ready(err)
	}
	if err != nil {
		closeAll(ls)
		return err
	}
	var wg sync.WaitGroup
	for i, l := range ls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := l.AcceptTCP()
				if err != nil {
					return
				}
				go func() {
					if _, err := f.Connect(ctx, ports[i].GuestAddr(), c); err != nil {
						c.SetLinger(0)
						c.Close()
						if ctx.Err() == nil && refused != nil {
							refused(ports[i], err)
						}
					}
				}()
			}
		}()
	}
	select {
	case <-ctx.Done():
	case <-f.Done():
	}
	closeAll(ls)
	wg.Wait()
	if ctx.Err() != nil {
		return nil
	}
	return h.boxGone(name, f)
}

// RemoteMessage is what an agent said of err, or err's text.
func RemoteMessage(err error) string {
	var re *agent.RemoteError
	if errors.As(err, &re) {
		return re.Message
	}
	return err.Error()
}

// boxGone says how forwarding to name ended when the agent connection went
// away.
func (h *Host) boxGone(name string, f *agent.Forwarder) error {
	h.dropForwarder(name)
	why := f.Err()
	// The channel closes as QEMU ends, a moment before libvirt says so.
	// A removed box is stopped first, then undefined: a box seen stopped
	// is said stopped only if it is still there a second later.
	deadline := time.Now().Add(5 * time.Second)
	var stoppedAt time.Time
	var state domain.State
	for time.Now().Before(deadline) {
		b, err := h.d.Get(name)
		switch {
		case errors.Is(err, base.ErrNotFound):
			return fmt.Errorf("box %q was removed: port forwarding ended", name)
		case err == nil && b.State != domain.StateRunning && stoppedAt.IsZero():
			stoppedAt, state = time.Now(), b.State
		}
		if !stoppedAt.IsZero() && time.Since(stoppedAt) > time.Second {
			return fmt.Errorf("box %q is %s: port forwarding ended", name, state)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("box %q: the agent connection ended (%v): port forwarding ended", name, why)
}

// Pipe is in and out as one connection for Connect (standard input and
// output, for ssh's ProxyCommand): the box's EOF closes out.
func Pipe(in io.Reader, out io.Writer) io.ReadWriteCloser { return pipe{in, out} }

type pipe struct {
	in  io.Reader
	out io.Writer
}

func (s pipe) Read(b []byte) (int, error)  { return s.in.Read(b) }
func (s pipe) Write(b []byte) (int, error) { return s.out.Write(b) }
func (s pipe) CloseWrite() error {
	if c, ok := s.out.(io.Closer); ok {
		return c.Close()
	}
	return nil
}
func (s pipe) Close() error {
	s.CloseWrite()
	if c, ok := s.in.(io.Closer); ok {
		return c.Close()
	}
	return nil
}
