package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ErrNoForward is returned when the box's agent predates TCP streams.
var ErrNoForward = errors.New("the guest agent in this box is too old to forward ports (its image or snapshot was built with an older kvbox-agent; rebuild it with this kvbox)")

// DefaultDialDeadline bounds how long Connect waits for the agent to
// answer a dial (Forwarder.DialDeadline).
const DefaultDialDeadline = 30 * time.Second

// Forwarder carries many TCP streams over one agent connection at once. It
// owns the Client from Forward until Close: no other call runs on it.
type Forwarder struct {
	// DialDeadline bounds the wait for the agent's answer to a dial: a
	// guest that never answers must not hold a goroutine and the caller's
	// connection for ever (a port holder would gather one of each per
	// connection). Forward sets DefaultDialDeadline.
	DialDeadline time.Duration

	// Tokens, if set, gives the tokens the box's agent may have now
	// (kvbox's files): when the agent refuses a dial because its token
	// changed (a snapshot of the box, which ends every other session's
	// rights), the forwarder presents them and dials again.
	Tokens func() [][]byte

	c   *Client
	end func(bool)

	authMu  sync.Mutex
	authGen atomic.Uint64 // bumped by each re-auth

	mu      sync.Mutex
	streams map[uint32]*stream
	pending map[uint32]chan response
	closed  bool

	done chan struct{}
	err  error // why the connection ended; set before done is closed
}

// Forward turns the connection into a stream carrier. It checks the agent
// serves streams (ErrNoForward otherwise).
func (c *Client) Forward(ctx context.Context) (*Forwarder, error) {
	end, err := c.begin(ctx)
	if err != nil {
		return nil, err
	}
	var in Info
	if err := c.roundTrip(ctx, c.nextID.Add(1), methodPing, nil, &in); err != nil {
		end(false)
		return nil, err
	}
	if !in.Capabilities.Forward {
		end(true)
		return nil, fmt.Errorf("%w (agent %s)", ErrNoForward, in.Version)
	}
	f := &Forwarder{DialDeadline: DefaultDialDeadline, c: c, end: end, streams: map[uint32]*stream{}, pending: map[uint32]chan response{}, done: make(chan struct{})}
	go f.dispatch()
	return f, nil
}

// Done is closed when the agent connection ends (the box stopped, was
// removed, or its agent restarted); Err then says why.
func (f *Forwarder) Done() <-chan struct{} { return f.done }

// Err is why the connection ended, once Done is closed.
func (f *Forwarder) Err() error {
	<-f.done
	return f.err
}

// dispatch routes every frame from the agent without ever blocking on a
// stream.
func (f *Forwarder) dispatch() {
	defer f.shutdown()
	for {
		var fr frame
		select {
		case x, ok := <-f.c.frames:
			if !ok {
				f.err = fmt.Errorf("agent connection: %w", f.c.rerr)
				return
			}
			fr = x
		case <-f.c.closed:
			f.err = errors.New("forwarder closed")
			return
		}
		switch fr.Type {
		case frameHello:
			var h helloMsg
			if json.Unmarshal(fr.Payload, &h) == nil && h.Started {
				f.c.dirty.Store(true)
				f.err = ErrAgentRestarted
				return
			}
		case frameResponse:
			var resp response
			json.Unmarshal(fr.Payload, &resp)
			f.mu.Lock()
			ch := f.pending[fr.ID]
			delete(f.pending, fr.ID)
			f.mu.Unlock()
			if ch != nil {
				ch <- resp
			} else if resp.Error == "" {
				// A dial we gave up on succeeded after all: end it.
				f.c.send(context.Background(), frameReset, fr.ID, []byte("abandoned"))
			}
		case frameData, frameDataAck, frameClose, frameReset:
			f.mu.Lock()
			s := f.streams[fr.ID]
			f.mu.Unlock()
			if s != nil {
				s.deliver(fr)
			}
		}
	}
}

func (f *Forwarder) shutdown() {
	f.mu.Lock()
	f.closed = true
	var all []*stream
	for _, s := range f.streams {
		all = append(all, s)
	}
	for id, ch := range f.pending {
		close(ch)
		delete(f.pending, id)
	}
	f.mu.Unlock()
	for _, s := range all {
		s.abort()
	}
	close(f.done)
}

// Connect asks the agent to dial addr inside the guest ("8000" is
// 127.0.0.1:8000) and joins the new stream to conn: bytes flow both ways,
// each side's EOF is passed on as a half-close (conn should implement
// CloseWrite, as TCP and unix connections do), and conn is closed when the
// stream has ended both ways or was reset. The returned channel is closed
// then. On error conn is left open. A dial the agent has not answered
// within DialDeadline fails with a *DialDeadlineError.
func (f *Forwarder) Connect(ctx context.Context, addr string, conn io.ReadWriteCloser) (<-chan struct{}, error) {
	if f.DialDeadline > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, f.DialDeadline, &DialDeadlineError{Address: addr, After: f.DialDeadline})
		defer cancel()
	}
	gen := f.authGen.Load()
	ended, err := f.connect(ctx, addr, conn)
	var re *RemoteError
	if errors.As(err, &re) && strings.Contains(re.Message, ErrUnauthorized.Error()) && f.Tokens != nil {
		if aerr := f.reauth(ctx, gen); aerr != nil {
			return nil, fmt.Errorf("%w (and presenting the box's token again: %v)", err, aerr)
		}
		return f.connect(ctx, addr, conn)
	}
	return ended, err
}

// reauth presents the box's tokens until the agent takes one, unless
// another Connect has done so since gen.
func (f *Forwarder) reauth(ctx context.Context, gen uint64) error {
	f.authMu.Lock()
	defer f.authMu.Unlock()
	if f.authGen.Load() != gen {
		return nil
	}
	var errs []error
	for _, tok := range f.Tokens() {
		resp, err := f.request(ctx, methodAuth, authMsg{Token: tok})
		if err == nil && resp.Error == "" {
			f.c.Token = tok
			f.authGen.Add(1)
			return nil
		}
		if err == nil {
			err = errors.New(resp.Error)
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return errors.New("kvbox has no token for the box")
	}
	return errors.Join(errs...)
}

// request sends a request and waits for its response.
func (f *Forwarder) request(ctx context.Context, method string, params any) (response, error) {
	id := f.c.nextID.Add(1)
	ch := make(chan response, 1)
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return response{}, f.Err()
	}
	f.pending[id] = ch
	f.mu.Unlock()
	b, err := requestFrame(id, method, params)
	if err == nil {
		err = f.c.write(ctx, b)
	}
	if err != nil {
		f.forget(id)
		return response{}, err
	}
	select {
	case resp, ok := <-ch:
		if !ok {
			return response{}, f.Err()
		}
		return resp, nil
	case <-ctx.Done():
		f.forget(id)
		return response{}, context.Cause(ctx)
	}
}

func (f *Forwarder) connect(ctx context.Context, addr string, conn io.ReadWriteCloser) (<-chan struct{}, error) {
	id := f.c.nextID.Add(1)
	ch := make(chan response, 1)
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return nil, f.Err()
	}
	// The stream exists before the request is sent: the agent's data may
	// follow its answer at once, and dispatch drops the frames of a stream
	// it does not know (a stream registered after the send lost them when
	// this goroutine was slower than the agent, and stalled for good).
	ended := make(chan struct{})
	s := newStream(id, conn, func(t frameType, p []byte) error {
		return f.c.send(context.Background(), t, id, p)
	}, func(s *stream) {
		f.mu.Lock()
		delete(f.streams, s.id)
		f.mu.Unlock()
		close(ended)
	})
	f.pending[id] = ch
	f.streams[id] = s
	f.mu.Unlock()
	b, _ := json.Marshal(request{Method: methodDial, Params: mustJSON(DialRequest{Address: addr})})
	if err := f.c.send(ctx, frameRequest, id, b); err != nil {
		f.forget(id)
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, err
	}
	var resp response
	var ok bool
	select {
	case resp, ok = <-ch:
	case <-ctx.Done():
		f.forget(id)
		return nil, context.Cause(ctx)
	}
	if !ok {
		f.forget(id)
		return nil, f.Err()
	}
	if resp.Error != "" {
		f.forget(id)
		if resp.Error == fmt.Sprintf("unknown method %q", methodDial) {
			return nil, ErrNoForward
		}
		return nil, &RemoteError{Method: methodDial, Message: resp.Error}
	}
	s.start()
	return ended, nil
}

// DialDeadlineError is a dial the agent did not answer in time.
type DialDeadlineError struct {
	Address string
	After   time.Duration
}

func (e *DialDeadlineError) Error() string {
	return fmt.Sprintf("the box's agent did not answer the connection to %s within %s", e.Address, e.After)
}

// forget drops a stream that never started (its conn stays open).
func (f *Forwarder) forget(id uint32) {
	f.mu.Lock()
	delete(f.pending, id)
	delete(f.streams, id)
	f.mu.Unlock()
}

// Close ends every stream and the connection.
func (f *Forwarder) Close() error {
	err := f.c.Close()
	<-f.done
	f.end(false)
	return err
}

func mustJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}
