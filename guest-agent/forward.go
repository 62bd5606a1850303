package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// DialRequest asks the agent to open a TCP connection inside the guest.
type DialRequest struct {
	// Address is host:port as seen from inside the guest; a bare port
	// means 127.0.0.1; EnvdDialAddress is the agent's own envd.
	Address string `json:"address"`
}

func init() { registerOp(methodDial, authorizedOnly, (*session).dial) }

// dialTimeout bounds the agent's own connect.
const dialTimeout = 10 * time.Second

// dialGuest is the agent's connect to a guest address (a variable so that
// tests can hold a dial where it is).
var dialGuest = func(addr string) (net.Conn, error) { return net.DialTimeout("tcp", addr, dialTimeout) }

// guestAddress normalises a dial address: "8000" is 127.0.0.1:8000.
func guestAddress(a string) (string, error) {
	if a == "" {
		return "", errors.New("no address")
	}
	if _, _, err := net.SplitHostPort(a); err != nil {
		if _, perr := fmt.Sscanf(a, "%d", new(int)); perr == nil {
			return net.JoinHostPort("127.0.0.1", a), nil
		}
		return "", fmt.Errorf("address %q: %v", a, err)
	}
	return a, nil
}

// forwards is the agent side's set of streams of one session, and the
// slots of maxStreams they hold. A dial takes its slot as it starts, before
// the guest is dialled, and gives it back when it fails or its stream ends:
// dials under way count, so however many come at once, no more than the
// cap pass. Streams to guest ports may hold all but envdStreams of them.
type forwards struct {
	mu      sync.Mutex
	streams map[uint32]*stream
	held    int // slots taken: streams and dials under way
	ports   int // of them, those to guest ports (not envd)
}

// take takes a slot for a stream to envd or to a guest port, or says why
// none is free; release gives it back (once, however often it is called).
func (fw *forwards) take(envd bool) (release func(), err error) {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	switch {
	case fw.held >= maxStreams:
		return nil, fmt.Errorf("this connection already carries %d streams", fw.held)
	case !envd && fw.ports >= maxStreams-envdStreams:
		return nil, fmt.Errorf("this connection already carries %d streams to guest ports (its other streams are kept for envd)", fw.ports)
	}
	fw.held++
	if !envd {
		fw.ports++
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			fw.mu.Lock()
			fw.held--
			if !envd {
				fw.ports--
			}
			fw.mu.Unlock()
		})
	}, nil
}

func (fw *forwards) get(id uint32) *stream {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	return fw.streams[id]
}

// abortAll ends every stream (a new host, or the host went away).
func (fw *forwards) abortAll() {
	fw.mu.Lock()
	var all []*stream
	for _, s := range fw.streams {
		all = append(all, s)
	}
	fw.mu.Unlock()
	for _, s := range all {
		s.abort()
	}
}

// dial serves a "dial" request: take a slot, connect, register the stream,
// answer, and only then start moving bytes (so the answer precedes the
// first data).
func (ss *session) dial(gen uint64, id uint32, params json.RawMessage) {
	var req DialRequest
	if err := json.Unmarshal(params, &req); err != nil {
		ss.reply(gen, id, nil, fmt.Errorf("bad dial request: %v", err))
		return
	}
	addr := req.Address
	if addr != EnvdDialAddress {
		var err error
		if addr, err = guestAddress(req.Address); err != nil {
			ss.reply(gen, id, nil, err)
			return
		}
	}
	fw := &ss.fwd
	release, err := fw.take(addr == EnvdDialAddress)
	if err != nil {
		ss.reply(gen, id, nil, err)
		return
	}
	go func() {
		var conn net.Conn
		var err error
		if addr == EnvdDialAddress {
			conn, err = ss.srv.dialEnvd() // envd.go: in-process
		} else {
			conn, err = dialGuest(addr)
		}
		if err != nil {
			release()
			ss.reply(gen, id, nil, err)
			return
		}
		send := func(t frameType, p []byte) error { return ss.send(gen, t, id, p) }
		s := newStream(id, conn, send, func(s *stream) {
			fw.mu.Lock()
			if fw.streams[s.id] == s {
				delete(fw.streams, s.id)
			}
			fw.mu.Unlock()
			release()
		})
		fw.mu.Lock()
		if fw.streams == nil {
			fw.streams = map[uint32]*stream{}
		}
		if old := fw.streams[id]; old != nil {
			fw.mu.Unlock()
			conn.Close()
			release()
			ss.reply(gen, id, nil, fmt.Errorf("stream %d is already open", id))
			return
		}
		fw.streams[id] = s
		fw.mu.Unlock()
		if gen != ss.gen.Load() {
			s.abort() // the host changed while we dialled
			return
		}
		ss.reply(gen, id, nil, nil)
		s.start()
	}()
}

// streamFrame routes a host frame of a stream; frames of unknown streams
// (already ended) are dropped.
func (ss *session) streamFrame(f frame) {
	if s := ss.fwd.get(f.ID); s != nil {
		s.deliver(f)
	}
}
