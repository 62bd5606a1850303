package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"
)

// System is the seam between the agent and the guest's global state. The
// real one (NewLinuxSystem) changes the machine it runs on; tests use a fake
// so they never touch the test host's network, hostname or clock.
type System interface {
	// Capabilities reports which of the calls below can work here.
	Capabilities() Capabilities
	ApplyIdentity(Identity) error
	SetClock(time.Time) error
	AddEntropy([]byte) error
	ReprobeBalloon() error
}

// Server is the guest side: it answers one or many host connections.
type Server struct {
	System System
	// Log receives one line per notable event; nil means log.Default().
	Log *log.Logger
	// StateDir, when set, is where Identify persists the identity
	// (identity.json) so the agent can re-apply it after a reboot.
	StateDir string
	// Boost, when set, raises the agent's threads' priority while an
	// identify runs (boost.go).
	Boost bool

	vsock atomic.Bool // Serve is running on a vsock listener

	identifyMu sync.Mutex
	boosts     boosts // the identities being applied (boost.go)

	tokenMu       sync.Mutex // auth.go
	token         []byte
	tokenSnapshot bool
	tokenGen      uint64
	tokenRead     bool

	// EnvdAddr is where the envd feature listens in the guest once the
	// host has configured it (envd.go): DefaultEnvdAddr when empty, nowhere
	// with "-".
	EnvdAddr string
	envd     envdState
}

func (s *Server) logf(format string, args ...any) {
	l := s.Log
	if l == nil {
		l = log.Default()
	}
	l.Printf(format, args...)
}

// ServeConn serves one host connection that only the host's root can open
// (a test's pipe; trusted as a virtio-serial port is) until the host closes
// it or ctx ends. A running exec is killed when it returns.
func (s *Server) ServeConn(ctx context.Context, conn io.ReadWriteCloser) error {
	return s.serveConn(ctx, conn, true)
}

func (s *Server) serveConn(ctx context.Context, conn io.ReadWriteCloser, trusted bool) error {
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	defer conn.Close()
	err := s.serve(conn, conn, "conn", false, trusted)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// Serve accepts host connections on l (the vsock listener) until ctx ends,
// then waits for their sessions to end (and their execs to be killed).
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	if l.Addr().Network() == "vsock" {
		s.vsock.Store(true)
		defer s.vsock.Store(false)
	}
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		if !fromHost(c) {
			s.logf("vsock: refused %v: only the host (context %d) is served", c.RemoteAddr(), vsock.Host)
			c.Close()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Any local user of the host can connect over vsock.
			if err := s.serveConn(ctx, c, false); err != nil && ctx.Err() == nil {
				s.logf("vsock %v: %v", c.RemoteAddr(), err)
			}
		}()
	}
}

// fromHost reports whether a connection may be served: a vsock peer must be
// the host, never another context: not the guest itself (a guest user
// dialing its own agent over vsock loopback), not another guest. A
// connection of another kind (a test's listener) is the caller's to trust.
func fromHost(c net.Conn) bool {
	a, ok := c.RemoteAddr().(*vsock.Addr)
	return !ok || a.ContextID == vsock.Host
}

// serve runs the frame loop of one byte stream. r may return errHostGone
// (a virtio-serial port whose host went away): the running exec is killed
// and the loop goes on with a fresh decoder.
//
// With announce, the session starts by telling a host that may still be
// connected (a port, across an agent restart) that the agent started anew.
func (s *Server) serve(r io.Reader, w io.Writer, name string, announce, trusted bool) error {
	ss := &session{srv: s, w: w, name: name, trusted: trusted}
	defer ss.abort("connection closed")
	if announce {
		// Blocks until a host connects; dropped if a HELLO comes first.
		go ss.sendJSON(0, frameHello, 0, helloMsg{Version: Version, Started: true})
	}
	d := newDecoder(r)
	for {
		f, err := d.next()
		if d.skipped > 0 {
			s.logf("%s: skipped %d stale or garbage bytes", name, d.skipped)
			d.skipped = 0
		}
		if errors.Is(err, errHostGone) {
			ss.abort("host disconnected")
			ss.greeted = false
			d.reset()
			continue
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) {
			return nil
		}
		if err != nil {
			return err
		}
		ss.handle(f)
	}
}

var errStale = errors.New("agent: stale session")

// session is the state of one byte stream: at most one exec at a time, and
// a generation that HELLO bumps so output of an aborted exec never reaches
// the next host.
type session struct {
	srv  *Server
	name string

	wmu sync.Mutex
	w   io.Writer
	gen atomic.Uint64

	mu   sync.Mutex
	proc *process

	fwd forwards // TCP streams (forward.go)

	// greeted is set by a HELLO: frames before the first HELLO of a host
	// are leftovers of an earlier one and are dropped. Reader goroutine only.
	greeted bool
	// trusted: only the host's root can open this transport (virtio-serial);
	// authed: this host presented or set the token of generation authGen
	// (auth.go). Reader goroutine only.
	trusted, authed bool
	authGen         uint64
}

func (ss *session) send(gen uint64, t frameType, id uint32, payload []byte) error {
	ss.wmu.Lock()
	defer ss.wmu.Unlock()
	return ss.sendLocked(gen, t, id, payload)
}

// sendLocked is send with wmu held.
func (ss *session) sendLocked(gen uint64, t frameType, id uint32, payload []byte) error {
	if gen != ss.gen.Load() {
		return errStale
	}
	_, err := ss.w.Write(appendFrame(nil, t, id, payload))
	return err
}

func (ss *session) sendJSON(gen uint64, t frameType, id uint32, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return ss.send(gen, t, id, b)
}

func (ss *session) reply(gen uint64, id uint32, result any, err error) {
	var resp response
	if err != nil {
		resp.Error = err.Error()
	} else if result != nil {
		b, merr := json.Marshal(result)
		if merr != nil {
			resp.Error = merr.Error()
		}
		resp.Result = b
	}
	if err := ss.sendJSON(gen, frameResponse, id, resp); err != nil && !errors.Is(err, errStale) {
		ss.srv.logf("%s: reply: %v", ss.name, err)
	}
}

// abort kills the running exec (its whole process group) and makes every
// frame it still wants to send stale.
func (ss *session) abort(why string) {
	ss.gen.Add(1)
	ss.mu.Lock()
	p := ss.proc
	ss.proc = nil
	ss.mu.Unlock()
	if p != nil {
		ss.srv.logf("%s: %s: killing exec %q", ss.name, why, p.argv0)
		p.kill(unix.SIGKILL)
	}
	ss.fwd.abortAll()
}

func (ss *session) current(id uint32) *process {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.proc != nil && ss.proc.id == id {
		return ss.proc
	}
	return nil
}

func (ss *session) handle(f frame) {
	switch f.Type {
	case frameHello:
		if len(f.Payload) != 16 {
			return
		}
		ss.abort("new host")
		ss.greeted = true
		ss.greet()
		// The echo is written from a goroutine of its own, so that the
		// requests a host wrote behind its HELLO (a clone's first contact:
		// the token and the identity, in one write) are served meanwhile;
		// the write lock, taken here, keeps every reply behind the echo.
		gen, nonce := ss.gen.Load(), bytes.Clone(f.Payload)
		ss.wmu.Lock()
		go func() {
			defer ss.wmu.Unlock()
			if b, err := json.Marshal(helloMsg{Nonce: nonce, Version: Version}); err == nil {
				ss.sendLocked(gen, frameHello, f.ID, b)
			}
		}()
	case frameRequest:
		if ss.greeted {
			ss.request(f)
		}
	case frameStdin, frameStdinEOF:
		if p := ss.current(f.ID); p != nil {
			p.stdin(f)
		}
	case frameResize:
		var ws WinSize
		if p := ss.current(f.ID); p != nil && json.Unmarshal(f.Payload, &ws) == nil {
			p.resize(ws)
		}
	case frameSignal:
		var m signalMsg
		if p := ss.current(f.ID); p != nil && json.Unmarshal(f.Payload, &m) == nil && m.Signal > 0 && m.Signal < 65 {
			p.kill(unix.Signal(m.Signal))
		}
	case frameData, frameDataAck, frameClose, frameReset:
		ss.streamFrame(f)
	default:
		// Frames only the guest sends: a loop-back or garbage; ignore.
	}
}

func init() {
	registerOp(methodPing, beforeAuth, (*session).ping)
	registerOp(methodIdentify, authorizedOnly, (*session).identify)
	registerOp(methodSetClock, authorizedOnly, (*session).setClock)
	registerOp(methodAddEntropy, authorizedOnly, (*session).addEntropy)
}

func (ss *session) ping(gen uint64, id uint32, _ json.RawMessage) {
	ss.reply(gen, id, ss.srv.info(), nil)
}

func (ss *session) setClock(gen uint64, id uint32, params json.RawMessage) {
	var m clockMsg
	if err := json.Unmarshal(params, &m); err != nil {
		ss.reply(gen, id, nil, fmt.Errorf("bad clock: %v", err))
		return
	}
	go func() { ss.reply(gen, id, nil, ss.srv.sys().SetClock(time.Unix(0, m.UnixNano))) }()
}

func (ss *session) addEntropy(gen uint64, id uint32, params json.RawMessage) {
	var b []byte
	if err := json.Unmarshal(params, &b); err != nil {
		ss.reply(gen, id, nil, fmt.Errorf("bad entropy: %v", err))
		return
	}
	go func() { ss.reply(gen, id, nil, ss.srv.sys().AddEntropy(b)) }()
}

// identify applies a new identity in the background, the guest boosted
// until it is answered.
func (ss *session) identify(gen uint64, reqID uint32, params json.RawMessage) {
	s := ss.srv
	// Boosted from here, on the reader: in a clone's pipeline the clock,
	// the entropy and the ping behind the identity are then served
	// boosted too, and the guest's other processes wait from the first
	// frame the agent can tell is a re-identification.
	end := func() {}
	if s.Boost {
		end = s.boosts.start()
	}
	var id Identity
	if err := json.Unmarshal(params, &id); err != nil {
		end()
		ss.reply(gen, reqID, nil, fmt.Errorf("bad identity: %v", err))
		return
	}
	go func() {
		err := s.identify(id)
		ss.reply(gen, reqID, nil, err)
		end() // after the answer the host waits for
		if err == nil {
			// Said after the answer: the host waits for that, and the
			// console is slow under emulation.
			s.logf("identity applied: hostname=%q mac=%q address=%q", id.Hostname, id.MAC, id.Address)
		}
	}()
}

func (ss *session) finished(p *process) {
	ss.mu.Lock()
	if ss.proc == p {
		ss.proc = nil
	}
	ss.mu.Unlock()
}

func (s *Server) sys() System {
	if s.System == nil {
		return noSystem{}
	}
	return s.System
}

func (s *Server) info() Info {
	in := Info{Version: Version, Capabilities: s.sys().Capabilities()}
	in.Capabilities.Exec = true
	in.Capabilities.Forward = true
	in.Capabilities.Vsock = s.vsock.Load()
	in.Features = Features()
	in.AfterCloneHooks = hookCount()
	if _, err := os.Stat("/dev/ptmx"); err == nil {
		in.Capabilities.TTY = true
	}
	in.Hostname, _ = os.Hostname()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		in.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		in.Uptime = time.Duration(si.Uptime) * time.Second
	}
	in.BootID = bootID()
	return in
}

// bootIDCache holds the kernel's boot_id once read: it cannot change under
// a running process (a guest that boots again runs a new agent).
var bootIDCache atomic.Value

// bootID is the guest kernel's boot_id ("" where it cannot be read).
func bootID() string {
	if id, _ := bootIDCache.Load().(string); id != "" {
		return id
	}
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	id := strings.TrimSpace(string(b))
	bootIDCache.Store(id)
	return id
}

func (s *Server) identify(id Identity) error {
	if err := id.Validate(); err != nil {
		return err
	}
	// One at a time, to the identity saved last: a host that retried its
	// first contact may have it served twice at once.
	s.identifyMu.Lock()
	defer s.identifyMu.Unlock()
	// The system's identity and the SSH host keys are made at once: a
	// clone runs all of it on cold code, and has two vCPUs.
	keys := make(chan error, 1)
	go func() { keys <- s.renewHostKeys(id) }() // sshkeys.go
	err := s.sys().ApplyIdentity(id)
	if kerr := <-keys; err == nil {
		err = kerr
	}
	if err != nil {
		return err
	}
	if s.StateDir == "" {
		return nil
	}
	if err := SaveIdentity(s.StateDir, id); err != nil {
		return fmt.Errorf("identity applied but not persisted: %w", err)
	}
	return nil
}

// identityFile is where the identity is persisted inside StateDir.
const identityFile = "identity.json"

// SaveIdentity writes id to dir/identity.json atomically.
func SaveIdentity(dir string, id Identity) error {
	b, err := json.MarshalIndent(id, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return writeFileDurable(dir+"/"+identityFile, append(b, '\n'), 0o644)
}

// LoadIdentity reads the identity SaveIdentity wrote; ok is false when
// there is none.
func LoadIdentity(dir string) (id Identity, ok bool, err error) {
	b, err := os.ReadFile(dir + "/" + identityFile)
	if errors.Is(err, os.ErrNotExist) {
		return id, false, nil
	}
	if err != nil {
		return id, false, err
	}
	if err := json.Unmarshal(b, &id); err != nil {
		return id, false, fmt.Errorf("%s/%s: %w", dir, identityFile, err)
	}
	return id, true, nil
}

func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	return writeFile(path, data, perm, false)
}

// writeFileDurable is writeFileAtomic whose file is on the disk when it
// returns: the data before the rename, the rename after it. For what the
// host acts on once the agent answered (its token, the box's identity): a
// box powered off right after, its guest's page cache lost, boots with
// them, not with whatever the disk held before.
func writeFileDurable(path string, data []byte, perm os.FileMode) error {
	return writeFile(path, data, perm, true)
}

func writeFile(path string, data []byte, perm os.FileMode, durable bool) error {
	tmp := path + ".kvbox-tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil && durable {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	if durable {
		return syncDir(filepath.Dir(path))
	}
	return nil
}

// syncDir makes the entries of the folder dir durable (a rename in it).
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, unix.EINVAL) {
		return err
	}
	return nil
}

// noSystem refuses every change; Server uses it when System is nil.
type noSystem struct{}

func (noSystem) Capabilities() Capabilities   { return Capabilities{} }
func (noSystem) ApplyIdentity(Identity) error { return errors.ErrUnsupported }
func (noSystem) SetClock(time.Time) error     { return errors.ErrUnsupported }
func (noSystem) AddEntropy([]byte) error      { return errors.ErrUnsupported }
func (noSystem) ReprobeBalloon() error        { return errors.ErrUnsupported }
