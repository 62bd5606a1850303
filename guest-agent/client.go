package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/base"
)

// ErrBusy is returned by DialSerial when every port is in use by another
// kvbox command.
var ErrBusy = errors.New("every agent port is busy")

// ErrAgentRestarted is returned by a call that was in flight on a port when
// the agent restarted: the call is lost, the next one starts afresh.
var ErrAgentRestarted = errors.New("the guest agent restarted")

// Client is the host side of one connection to the agent. Calls are
// serialised: one call at a time per Client (open several Clients, over
// several ports, for concurrent work). A call whose context ends midway
// leaves the stream in an unknown state; the next call opens with a fresh
// HELLO, which also makes the guest abort what the interrupted call
// started.
type Client struct {
	conn   net.Conn
	unlock func()

	frames chan frame
	closed chan struct{}
	rerr   error // set before frames is closed

	sem    chan struct{} // one call at a time
	nextID atomic.Uint32
	synced bool // under sem: a HELLO was answered and no call broke since
	dirty  atomic.Bool

	wmu       sync.Mutex
	closeOnce sync.Once

	infoOnce sync.Mutex
	info     *Info // Ping's answer, once a call needed it (require)

	// Token, when set before the first call, is presented to the agent
	// after every HELLO (auth.go). An agent older than the feature does not
	// know auth and is served as before.
	Token []byte
	// Provisioned says whether the agent had a token at the last auth.
	Provisioned bool
	// BootID is the guest's boot_id from the last auth ("" without auth,
	// or from an agent older than it).
	BootID string
}

// NewClient wraps a connection to an agent. The HELLO handshake happens on
// the first call.
func NewClient(conn net.Conn) *Client {
	c := &Client{
		conn:   conn,
		frames: make(chan frame),
		closed: make(chan struct{}),
		sem:    make(chan struct{}, 1),
	}
	go c.readLoop()
	return c
}

// DialSerial connects to the first free virtio-serial port among
// socketPaths (the host ends of the box's agent channels). A port is free
// when a non-blocking flock on path+".lock" succeeds; the lock is held until
// Close, because QEMU serves one connection per port and would leave a
// second one hanging unanswered.
//
// To wait for a booting box, call DialSerial once with the whole boot
// timeout in ctx: QEMU accepts the connection before the guest opens its
// port and the HELLO (retried) is answered as soon as the agent reads it.
func DialSerial(ctx context.Context, socketPaths []string) (*Client, error) {
	return DialSerialToken(ctx, socketPaths, nil)
}

// DialSerialToken is DialSerial presenting token (see Client.Token).
func DialSerialToken(ctx context.Context, socketPaths []string, token []byte) (*Client, error) {
	return dialSerial(ctx, socketPaths, token, true)
}

// OpenSerial is DialSerialToken without the handshake: the first call
// makes it, and a Pipeline then writes its requests right behind the HELLO
// and the token (one round trip for all of it: a clone's first contact).
func OpenSerial(ctx context.Context, socketPaths []string, token []byte) (*Client, error) {
	return dialSerial(ctx, socketPaths, token, false)
}

func dialSerial(ctx context.Context, socketPaths []string, token []byte, handshake bool) (*Client, error) {
	var errs []error
	for _, p := range socketPaths {
		// The box's folder is QEMU's: base.Lock never follows a link
		// planted in the lock's place.
		lf, err := base.Lock(p+".lock", false)
		if err != nil {
			if !errors.Is(err, base.ErrLocked) {
				errs = append(errs, err)
			}
			continue
		}
		var d net.Dialer
		conn, err := d.DialContext(ctx, "unix", p)
		if err != nil {
			lf.Unlock()
			errs = append(errs, err)
			continue
		}
		c := NewClient(conn)
		c.Token = token
		c.unlock = func() { lf.Unlock() }
		if !handshake {
			return c, nil
		}
		if err := c.handshake(ctx); err != nil {
			c.Close()
			return nil, fmt.Errorf("agent on %s: %w", p, err)
		}
		return c, nil
	}
	if len(errs) == 0 {
		return nil, ErrBusy
	}
	return nil, errors.Join(errs...)
}

// DialVsock connects to the agent of the guest with context id cid,
// presenting token (see Client.Token).
func DialVsock(ctx context.Context, cid uint32, token []byte) (*Client, error) {
	c, err := OpenVsock(ctx, cid, token)
	if err != nil {
		return nil, err
	}
	if err := c.handshake(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// OpenVsock is DialVsock without the handshake (see OpenSerial).
func OpenVsock(ctx context.Context, cid uint32, token []byte) (*Client, error) {
	conn, err := vsock.DialContext(ctx, cid, VsockPort, nil)
	if err != nil {
		return nil, err
	}
	c := NewClient(conn)
	c.Token = token
	return c, nil
}

// Close closes the connection and releases the port.
func (c *Client) Close() error {
	var err error
	c.closeOnce.Do(func() {
		close(c.closed)
		err = c.conn.Close()
		if c.unlock != nil {
			c.unlock()
		}
	})
	return err
}

func (c *Client) readLoop() {
	d := newDecoder(c.conn)
	for {
		f, err := d.next()
		if err != nil {
			c.rerr = err
			close(c.frames)
			return
		}
		select {
		case c.frames <- f:
		case <-c.closed:
			return
		}
	}
}

func (c *Client) recv(ctx context.Context) (frame, error) { return c.recvOr(ctx, nil) }

// errTimer is recvOr's answer when timer fired first.
var errTimer = errors.New("timer")

func (c *Client) recvOr(ctx context.Context, timer <-chan time.Time) (frame, error) {
	select {
	case <-timer:
		return frame{}, errTimer
	case f, ok := <-c.frames:
		if !ok {
			return f, fmt.Errorf("agent connection: %w", c.rerr)
		}
		var h helloMsg
		if f.Type == frameHello && json.Unmarshal(f.Payload, &h) == nil && h.Started {
			c.dirty.Store(true)
			return f, ErrAgentRestarted
		}
		return f, nil
	case <-ctx.Done():
		return frame{}, ctx.Err()
	case <-c.closed:
		return frame{}, net.ErrClosed
	}
}

// write sends raw bytes, giving up when ctx ends.
func (c *Client) write(ctx context.Context, b []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	dl, hasDeadline := ctx.Deadline()
	c.conn.SetWriteDeadline(dl)
	stop := context.AfterFunc(ctx, func() { c.conn.SetWriteDeadline(time.Unix(1, 0)) })
	_, err := c.conn.Write(b)
	if !stop() {
		err = errors.Join(err, ctx.Err())
	}
	c.conn.SetWriteDeadline(time.Time{})
	if err != nil {
		c.dirty.Store(true) // maybe half a frame: resync before the next call
		if hasDeadline && errors.Is(err, os.ErrDeadlineExceeded) && !time.Now().Before(dl) {
			// The socket's deadline is ctx's, on a timer of its own that
			// can fire first: the call ends for ctx's reason.
			<-ctx.Done()
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return err
}

func (c *Client) send(ctx context.Context, t frameType, id uint32, payload []byte) error {
	return c.write(ctx, appendFrame(nil, t, id, payload))
}

// take takes the call slot; end gives it back, ok false when the stream
// may be out of sync.
func (c *Client) take(ctx context.Context) (end func(ok bool), err error) {
	select {
	case c.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-c.closed:
		return nil, net.ErrClosed
	}
	return func(ok bool) {
		if !ok {
			c.synced = false
		}
		<-c.sem
	}, nil
}

// needsHello says whether the next call must start with a handshake.
// Under the call slot.
func (c *Client) needsHello() bool { return !c.synced || c.dirty.Load() }

// begin takes the call slot and makes sure the stream is in sync.
func (c *Client) begin(ctx context.Context) (end func(ok bool), err error) {
	end, err = c.take(ctx)
	if err != nil {
		return nil, err
	}
	if c.needsHello() {
		if err := c.hello(ctx, nil); err != nil {
			end(false)
			return nil, err
		}
		if err := c.auth(ctx); err != nil {
			end(false)
			return nil, err
		}
	}
	return end, nil
}

// auth presents the token, if the client has one.
func (c *Client) auth(ctx context.Context) error {
	if c.Token == nil {
		return nil
	}
	var r authReply
	err := c.roundTrip(ctx, c.nextID.Add(1), methodAuth, authMsg{Token: c.Token}, &r)
	return c.authResult(r, err)
}

// authResult takes the agent's answer to auth.
func (c *Client) authResult(r authReply, err error) error {
	var re *RemoteError
	switch {
	case errors.As(err, &re) && strings.Contains(re.Message, "unknown method"):
		return nil // an agent without auth
	case errors.As(err, &re):
		return fmt.Errorf("%w (%s)", ErrUnauthorized, re.Message)
	case err != nil:
		return err
	}
	c.Provisioned = r.Provisioned
	c.BootID = r.BootID
	return nil
}

// handshake runs HELLO now instead of on the first call.
func (c *Client) handshake(ctx context.Context) error {
	end, err := c.begin(ctx)
	if err != nil {
		return err
	}
	end(true)
	return nil
}

// hello sends HELLO with a fresh nonce and discards everything until the
// guest echoes it. When no echo comes quickly, the guest may be stuck
// waiting for the payload of a stale, cut-short frame: the retry first
// sends a run of zeros longer than any frame, which completes (and fails
// the CRC of) whatever the guest is waiting for.
//
// tail, if set, gives the frames written right behind each HELLO (in the
// same write): requests that the agent serves once it greeted the host.
// A retry writes them again, as tail makes them then (with fresh ids).
func (c *Client) hello(ctx context.Context, tail func() ([]byte, error)) error {
	var nonce [16]byte
	rand.Read(nonce[:])
	id := c.nextID.Add(1)
	c.dirty.Store(false)
	hello := appendFrame(nil, frameHello, id, nonce[:])
	msg := func() ([]byte, error) {
		if tail == nil {
			return hello, nil
		}
		t, err := tail()
		return append(hello[:len(hello):len(hello)], t...), err
	}
	first, err := msg()
	if err != nil {
		return err
	}
	if err := c.write(ctx, first); err != nil {
		return err
	}
	retry := 300 * time.Millisecond
	if tail != nil {
		// A retry writes the requests again, which a guest that was only
		// slow (a large clone under TCG answers in hundreds of ms)
		// serves twice: waited for longer before the guest is taken as
		// stuck.
		retry = time.Second
	}
	timer := time.NewTimer(retry)
	defer timer.Stop()
	pad := make([]byte, headerLen+MaxPayload)
	for {
		select {
		case f, ok := <-c.frames:
			if !ok {
				return fmt.Errorf("agent connection: %w", c.rerr)
			}
			if f.Type != frameHello {
				continue
			}
			var r struct {
				Nonce []byte `json:"nonce"`
			}
			if json.Unmarshal(f.Payload, &r) == nil && bytes.Equal(r.Nonce, nonce[:]) {
				c.synced = true
				return nil
			}
		case <-timer.C:
			again, err := msg()
			if err != nil {
				return err
			}
			if err := c.write(ctx, append(pad, again...)); err != nil {
				return err
			}
			c.dirty.Store(false)
			retry = min(2*retry, 2*time.Second)
			timer.Reset(retry)
		case <-ctx.Done():
			return fmt.Errorf("no answer from the guest agent: %w", ctx.Err())
		case <-c.closed:
			return net.ErrClosed
		}
	}
}

// roundTrip sends a request and waits for its response, ignoring frames
// of other calls.
func (c *Client) roundTrip(ctx context.Context, id uint32, method string, params, result any) error {
	if err := c.sendRequest(ctx, id, method, params); err != nil {
		return err
	}
	for {
		f, err := c.recv(ctx)
		if err != nil {
			return err
		}
		if f.Type == frameResponse && f.ID == id {
			return decodeResponse(method, f.Payload, result)
		}
	}
}

func (c *Client) sendRequest(ctx context.Context, id uint32, method string, params any) error {
	f, err := requestFrame(id, method, params)
	if err != nil {
		return err
	}
	return c.write(ctx, f)
}

// requestFrame is the frame of a request.
func requestFrame(id uint32, method string, params any) ([]byte, error) {
	req := request{Method: method}
	if params != nil {
		b, err := json.Marshal(params)
		if err != nil {
			return nil, err
		}
		req.Params = b
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if len(b) > MaxPayload {
		return nil, fmt.Errorf("%s: request too large (%d bytes)", method, len(b))
	}
	return appendFrame(nil, frameRequest, id, b), nil
}

// decodeResponse is a response's error, or its result into result.
func decodeResponse(method string, payload []byte, result any) error {
	var resp response
	if err := json.Unmarshal(payload, &resp); err != nil {
		return fmt.Errorf("%s: bad response: %w", method, err)
	}
	if resp.Error != "" {
		return &RemoteError{Method: method, Message: resp.Error}
	}
	if result != nil {
		if err := json.Unmarshal(resp.Result, result); err != nil {
			return fmt.Errorf("%s: bad result: %w", method, err)
		}
	}
	return nil
}

func (c *Client) call(ctx context.Context, method string, params, result any) error {
	end, err := c.begin(ctx)
	if err != nil {
		return err
	}
	err = c.roundTrip(ctx, c.nextID.Add(1), method, params, result)
	var re *RemoteError
	end(err == nil || errors.As(err, &re))
	return err
}

// Call is one request of a Pipeline.
type Call struct {
	Method string
	Params any
	Result any // where the reply's result is decoded to (nil: dropped)
}

// Pipeline sends every call at once and waits for all the replies: one
// round trip instead of one per call (the agent serves each request in a
// goroutine of its own, so the calls must not depend on each other's
// order). errs[i] is calls[i]'s outcome; err is the channel's, or
// ErrUnauthorized (wrapped) when the agent refused the token.
//
// On a client whose stream is not in sync yet (OpenSerial, OpenVsock) the
// HELLO and the token go in the same write, ahead of the calls (but a
// set-token, which goes once the HELLO is answered): the handshake costs
// no round trip of its own.
func (c *Client) Pipeline(ctx context.Context, calls ...Call) (errs []error, err error) {
	end, err := c.take(ctx)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() { end(ok) }()
	p := &pipelined{c: c, calls: calls, ids: map[uint32]int{}}
	if err := p.send(ctx); err != nil {
		return nil, err
	}
	if errs, err = p.replies(ctx); err != nil {
		return nil, err
	}
	ok = true
	return errs, nil
}

// pipelined is a Pipeline's calls in flight.
type pipelined struct {
	c      *Client
	calls  []Call
	ids    map[uint32]int // the request id of calls[i], to i
	authID uint32         // the token's request, 0 once answered or when none
}

// heldForHello says a call goes only once the HELLO is answered. On a
// first contact a change of token waits for the HELLO's echo: a HELLO
// retried before it (a guest slow to answer, or stuck on a stale frame)
// must present the token the agent still has. So does envd-init: a HELLO
// retried with the calls makes a slow guest serve them twice, and two
// envd-inits at once would race on the configuration file.
func heldForHello(call Call) bool {
	return call.Method == methodSetToken || call.Method == methodEnvdInit
}

// send writes the calls: with the HELLO and the token on a client not in
// sync yet (those held for it once it is answered), else all at once.
func (p *pipelined) send(ctx context.Context) error {
	if !p.c.needsHello() {
		b, err := p.frames(false, func(Call) bool { return true })
		if err != nil {
			return err
		}
		return p.c.write(ctx, b)
	}
	err := p.c.hello(ctx, func() ([]byte, error) {
		clear(p.ids)
		return p.frames(true, func(call Call) bool { return !heldForHello(call) })
	})
	if err != nil {
		return err
	}
	late, err := p.frames(false, heldForHello)
	if err != nil {
		return err
	}
	if len(late) > 0 {
		return p.c.write(ctx, late)
	}
	return nil
}

// frames are the requests of the calls pick takes, behind the token with
// auth.
func (p *pipelined) frames(auth bool, pick func(Call) bool) ([]byte, error) {
	var b []byte
	if auth && p.c.Token != nil {
		p.authID = p.c.nextID.Add(1)
		f, err := requestFrame(p.authID, methodAuth, authMsg{Token: p.c.Token})
		if err != nil {
			return nil, err
		}
		b = append(b, f...)
	}
	for i, call := range p.calls {
		if !pick(call) {
			continue
		}
		id := p.c.nextID.Add(1)
		f, err := requestFrame(id, call.Method, call.Params)
		if err != nil {
			return nil, err
		}
		b = append(b, f...)
		p.ids[id] = i
	}
	return b, nil
}

// replies reads frames until every call and the token are answered: each
// call's outcome, or the token's refusal.
func (p *pipelined) replies(ctx context.Context) ([]error, error) {
	errs := make([]error, len(p.calls))
	for len(p.ids) > 0 || p.authID != 0 {
		f, err := p.c.recv(ctx)
		if err != nil {
			return nil, err
		}
		if f.Type != frameResponse {
			continue
		}
		if f.ID == p.authID {
			p.authID = 0
			var r authReply
			err := decodeResponse(methodAuth, f.Payload, &r)
			if err := p.c.authResult(r, err); err != nil {
				// The calls behind it are refused too; their replies
				// are left behind (the next call starts with a HELLO).
				return nil, err
			}
			continue
		}
		if i, mine := p.ids[f.ID]; mine {
			delete(p.ids, f.ID)
			errs[i] = decodeResponse(p.calls[i].Method, f.Payload, p.calls[i].Result)
		}
	}
	return errs, nil
}

// Ping asks the agent who it is; a box is ready when this answers.
func (c *Client) Ping(ctx context.Context) (Info, error) {
	var in Info
	err := c.call(ctx, methodPing, nil, &in)
	return in, err
}

// Identify gives the guest a new identity (after a clone) and makes it
// persist across reboots.
func (c *Client) Identify(ctx context.Context, id Identity) error {
	return c.call(ctx, methodIdentify, id, nil)
}

// SetClock sets the guest's CLOCK_REALTIME.
func (c *Client) SetClock(ctx context.Context, t time.Time) error {
	return c.call(ctx, methodSetClock, clockMsg{UnixNano: t.UnixNano()}, nil)
}

// Reidentify gives the guest an identity, sets its clock to now, mixes
// seed into its RNG and, with a token, makes that the agent's token (the
// client keeps presenting its own until the caller changes it), in one
// round trip (the requests pipelined). The agent's info (Ping) comes in
// the same round trip and is kept for the calls that check it (the
// after-clone hooks ask whether there are any). Extra calls (a sandbox's
// envd-init, EnvdInitCall) go in the same round trip. It says which of
// them failed; an agent older than tokens takes the rest.
func (c *Client) Reidentify(ctx context.Context, id Identity, now time.Time, seed, token []byte, extra ...Call) error {
	if len(seed) > 4096 {
		return errors.New("Reidentify: at most 4096 bytes of seed")
	}
	var info Info
	// The ping goes last: the agent answers it on its reader, and the
	// identity, which takes longest, starts first.
	calls := []Call{{Method: methodIdentify, Params: id}, {Method: methodSetClock, Params: clockMsg{UnixNano: now.UnixNano()}},
		{Method: methodAddEntropy, Params: seed}, {Method: methodPing, Result: &info}}
	if token != nil {
		calls = append(calls, Call{Method: methodSetToken, Params: authMsg{Token: token}})
	}
	calls = append(calls, extra...)
	errs, err := c.Pipeline(ctx, calls...)
	if err != nil {
		return err
	}
	whats := map[string]string{methodIdentify: "set the identity", methodSetClock: "set the clock", methodAddEntropy: "seed the RNG",
		methodPing: "ask the agent who it is", methodSetToken: "give the agent its token", methodEnvdInit: "configure its envd"}
	for i, call := range calls {
		var re *RemoteError
		switch {
		case call.Method == methodPing && errs[i] == nil:
			c.infoOnce.Lock()
			c.info = &info
			c.infoOnce.Unlock()
		case call.Method == methodSetToken && errors.As(errs[i], &re) && strings.Contains(re.Message, "unknown method"):
			errs[i] = nil // an agent without auth
		}
		if errs[i] != nil {
			what := whats[call.Method]
			if what == "" {
				what = call.Method
			}
			errs[i] = fmt.Errorf("%s: %w", what, errs[i])
		}
	}
	return errors.Join(errs...)
}

// AddEntropy mixes b into the guest's RNG and credits it as entropy.
func (c *Client) AddEntropy(ctx context.Context, b []byte) error {
	if len(b) > 4096 {
		return errors.New("AddEntropy: at most 4096 bytes at a time")
	}
	return c.call(ctx, methodAddEntropy, b, nil)
}

// Exec runs req in the guest and streams its I/O. stdin may be nil (the
// process then sees EOF at once, or nothing with a TTY); it is read in
// chunks and forwarded, and its EOF closes the process's stdin (with a TTY:
// sends ^D). stdout receives the output (the only stream with a TTY);
// stderr may be nil to discard it. resize, which may be nil, carries window
// size changes for a TTY. The result is the exit code, 128+signal for a
// signal.
//
// When ctx ends the remote process group is killed. A Read on stdin that
// never returns is left behind in a goroutine that drops its data.
func (c *Client) Exec(ctx context.Context, req ExecRequest, stdin io.Reader, stdout, stderr io.Writer, resize <-chan WinSize) (int, error) {
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	end, err := c.begin(ctx)
	if err != nil {
		return -1, err
	}
	id := c.nextID.Add(1)
	code, err := c.exec(ctx, id, req, stdin, stdout, stderr, resize)
	var re *RemoteError
	end(err == nil || errors.As(err, &re))
	return code, err
}

func (c *Client) exec(ctx context.Context, id uint32, req ExecRequest, stdin io.Reader, stdout, stderr io.Writer, resize <-chan WinSize) (int, error) {
	if err := c.roundTrip(ctx, id, methodExec, req, nil); err != nil {
		return -1, err
	}
	ectx, cancel := context.WithCancel(ctx)
	defer cancel()
	x := &execRun{c: c, id: id, req: req, stdout: stdout, stderr: stderr, credits: make(chan struct{}, stdinWindow)}
	for range stdinWindow {
		x.credits <- struct{}{}
	}
	if stdin != nil {
		go c.forwardStdin(ectx, id, stdin, x.credits)
	} else if !req.TTY {
		if err := c.send(ctx, frameStdinEOF, id, nil); err != nil {
			return -1, err
		}
	}
	if resize != nil {
		go c.forwardResize(ectx, id, resize)
	}
	var timer <-chan time.Time
	if req.Timeout > 0 {
		t := time.NewTimer(req.Timeout)
		defer t.Stop()
		timer = t.C
	}
	for {
		f, err := c.recvOr(ctx, timer)
		if errors.Is(err, errTimer) {
			if x.timedOut {
				return -1, fmt.Errorf("exec: the command's process group was killed after %s but the agent reported no exit", req.Timeout)
			}
			x.timedOut = true
			timer = time.After(killGrace)
			if err := c.signal(ctx, id, unix.SIGKILL); err != nil {
				return -1, err
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				// Best effort: the next call's HELLO kills it anyway.
				kctx, kcancel := context.WithTimeout(context.Background(), time.Second)
				c.signal(kctx, id, unix.SIGKILL)
				kcancel()
			}
			return -1, err
		}
		if f.ID != id {
			continue
		}
		if code, done, err := x.frame(ctx, f); done || err != nil {
			return code, err
		}
	}
}

// execRun is one exec being run: where its output goes and what happened.
type execRun struct {
	c              *Client
	id             uint32
	req            ExecRequest
	stdout, stderr io.Writer
	credits        chan struct{} // stdin frames the agent may still take
	outErr         error         // writing output failed
	timedOut       bool          // the timeout killed the process group
}

// frame handles one frame of the exec; done is set by its exit.
func (x *execRun) frame(ctx context.Context, f frame) (code int, done bool, err error) {
	switch f.Type {
	case frameStdout, frameStderr:
		if x.outErr != nil {
			return 0, false, nil
		}
		w := x.stdout
		if f.Type == frameStderr {
			w = x.stderr
		}
		if _, err := w.Write(f.Payload); err != nil {
			// Like a pipe's reader going away: SIGPIPE the process,
			// keep draining until its exit.
			x.outErr = err
			if err := x.c.signal(ctx, x.id, unix.SIGPIPE); err != nil {
				return -1, true, err
			}
		}
	case frameStdinAck:
		select {
		case x.credits <- struct{}{}:
		default:
		}
	case frameExit:
		var st exitStatus
		if err := json.Unmarshal(f.Payload, &st); err != nil {
			return -1, true, fmt.Errorf("exec: bad exit status: %w", err)
		}
		if st.Error != "" {
			return st.Code, true, fmt.Errorf("exec: the agent lost the process: %s", st.Error)
		}
		if x.timedOut && st.Code == 128+int(unix.SIGKILL) {
			return st.Code, true, &TimeoutError{After: x.req.Timeout}
		}
		if x.outErr != nil {
			return st.Code, true, fmt.Errorf("exec: writing output: %w", x.outErr)
		}
		return st.Code, true, nil
	}
	return 0, false, nil
}

// signal sends sig to the exec's process (group).
func (c *Client) signal(ctx context.Context, id uint32, sig unix.Signal) error {
	b, _ := json.Marshal(signalMsg{Signal: int(sig)})
	return c.send(ctx, frameSignal, id, b)
}

// forwardResize passes terminal size changes to the exec until ctx ends.
func (c *Client) forwardResize(ctx context.Context, id uint32, resize <-chan WinSize) {
	for {
		select {
		case ws, ok := <-resize:
			if !ok {
				return
			}
			b, _ := json.Marshal(ws)
			if c.send(ctx, frameResize, id, b) != nil {
				return
			}
		case <-ctx.Done():
			return
		}
	}
}

func (c *Client) forwardStdin(ctx context.Context, id uint32, r io.Reader, credits chan struct{}) {
	buf := make([]byte, chunkSize)
	for {
		select {
		case <-credits:
		case <-ctx.Done():
			return
		}
		n, err := r.Read(buf)
		if ctx.Err() != nil {
			return
		}
		if n > 0 {
			if c.send(ctx, frameStdin, id, buf[:n]) != nil {
				return
			}
		} else {
			credits <- struct{}{}
		}
		if err != nil {
			// EOF, or a read error: either way the process sees EOF.
			c.send(ctx, frameStdinEOF, id, nil)
			return
		}
	}
}
