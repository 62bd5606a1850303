package agent

import (
	"errors"
	"io"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// TCP streams through the agent channel (port-forward, ssh-proxy).
//
// The host asks for one with a "dial" request naming a guest address; the
// agent dials it and answers. From then on the request's id is the stream's
// id and both sides speak the same four frames:
//
//	data      bytes read from the local end
//	data-ack  one data frame was written to the local end (a credit)
//	close     the local end reached EOF: no more data (half-close)
//	reset     the stream is aborted (a payload may say why)
//
// Flow control is per stream and per direction: a side sends at most
// streamWindow data frames the peer has not acknowledged, and acknowledges
// a frame only once it is written to its local end. So a receiver buffers
// at most streamWindow frames per stream and never blocks the channel's
// reader: one slow stream cannot stall the others or grow memory.
//
// A local end closed both ways (Close, not CloseWrite: an HTTP transport
// done with its request, or whose client went) takes nothing more: its
// side sends close, waits until the peer has written every byte it sent,
// and then resets the stream, which closes the peer's local end too
// (gracefully: no byte that was acknowledged is lost), however long the
// peer's side would have stayed open. Only a unix socket's local end tells
// a close from a half-close (a TCP peer's FIN is the same for both).

const (
	// streamWindow is how many unacknowledged data frames a side may have
	// in flight on one stream (8 × 32 KiB).
	streamWindow = 8
)

// Stream caps of one agent session (variables so that tests can make them
// small).
var (
	// maxStreams bounds the streams one session carries at once: each
	// holds a socket in the guest and one on the host, two goroutines and
	// a window of frames, and a host that keeps opening them must meet a
	// bound well below the guest's and its own open files.
	maxStreams = 256
	// envdStreams of them are kept for streams to envd. Streams to the
	// guest's ports come from whoever reaches those ports (kvbox serve
	// forwards them without a credential unless the sandbox wants its
	// traffic token), streams to envd from the sandbox's owner only: no
	// number of the former may refuse the latter. It is more than one
	// SDK client holds at once (a stream per call in flight: a running
	// command's output, a transfer) and leaves the ports most of the cap.
	envdStreams = 64
)

// halfCloser is a local end that can end its write side alone
// (*net.TCPConn, *net.UnixConn, or a pair of pipes).
type halfCloser interface {
	CloseWrite() error
}

// stream joins one local end to frames of one id.
type stream struct {
	id   uint32
	conn io.ReadWriteCloser
	// send writes a frame of this stream to the channel.
	send func(t frameType, payload []byte) error
	// finished is called once, when the stream has ended both ways.
	finished func(*stream)

	credits chan struct{} // data frames we may still send
	in      chan frame    // data and close frames from the peer
	dead    chan struct{} // closed on abort
	peerEOF chan struct{} // closed when the peer's close comes

	mu        sync.Mutex
	readDone  bool // we sent close (or the stream was aborted)
	writeDone bool // the peer's close was applied (or aborted)
	aborted   bool
	ended     bool
	closeSeen bool // the peer's close came
	// received and written count the peer's data frames that came and
	// those written to the local end.
	received, written int
}

func newStream(id uint32, conn io.ReadWriteCloser, send func(frameType, []byte) error, finished func(*stream)) *stream {
	s := &stream{id: id, conn: conn, send: send, finished: finished,
		credits: make(chan struct{}, streamWindow),
		in:      make(chan frame, streamWindow+1),
		dead:    make(chan struct{}),
		peerEOF: make(chan struct{}),
	}
	for range streamWindow {
		s.credits <- struct{}{}
	}
	return s
}

func (s *stream) start() {
	go s.readLoop()
	go s.writeLoop()
}

// deliver hands a frame from the peer to the stream without blocking: a
// peer that overruns its window is a protocol error and resets the stream.
func (s *stream) deliver(f frame) {
	switch f.Type {
	case frameData, frameClose:
		s.mu.Lock()
		if f.Type == frameData {
			s.received++
		} else if !s.closeSeen {
			s.closeSeen = true
			close(s.peerEOF)
		}
		s.mu.Unlock()
		select {
		case s.in <- f:
		case <-s.dead:
		default:
			s.fail("peer overran the stream window")
		}
	case frameDataAck:
		select {
		case s.credits <- struct{}{}:
		default:
		}
	case frameReset:
		s.abort()
	}
}

// readLoop moves bytes from the local end to the peer.
func (s *stream) readLoop() {
	buf := make([]byte, chunkSize)
	for {
		select {
		case <-s.credits:
		case <-s.dead:
			return
		}
		n, err := s.conn.Read(buf)
		if n > 0 {
			if s.send(frameData, buf[:n]) != nil {
				s.abort()
				return
			}
		} else {
			select { // nothing sent: the credit goes back
			case s.credits <- struct{}{}:
			default:
			}
		}
		if errors.Is(err, io.EOF) {
			gone := hungUp(s.conn)
			if s.isAborted() || s.send(frameClose, nil) != nil {
				s.abort()
				return
			}
			if gone {
				s.endBoth()
				return
			}
			s.half(true)
			return
		}
		if err != nil {
			if !s.isAborted() {
				s.fail(err.Error())
			}
			return
		}
	}
}

// writeLoop moves the peer's bytes to the local end.
func (s *stream) writeLoop() {
	for {
		var f frame
		select {
		case f = <-s.in:
		case <-s.dead:
			return
		}
		if f.Type == frameClose {
			if hc, ok := s.conn.(halfCloser); ok {
				hc.CloseWrite()
			}
			s.half(false)
			return
		}
		if _, err := s.conn.Write(f.Payload); err != nil {
			if !s.isAborted() {
				s.fail(err.Error())
			}
			return
		}
		s.mu.Lock()
		s.written++
		s.mu.Unlock()
		if s.send(frameDataAck, nil) != nil {
			s.abort()
			return
		}
	}
}

// closeGrace bounds how long a stream whose local end was closed waits for
// the peer to take its last bytes: a peer that reads takes a window in far
// less, and one that does not would otherwise hold the stream as long as
// it likes.
const closeGrace = 30 * time.Second

// endBoth ends the stream once the local end, closed both ways, has had
// its close sent: when every data frame sent is acknowledged (written to
// the peer's local end) it resets the stream, unless the peer ended its
// own direction meanwhile (then it ends as a half-close does).
func (s *stream) endBoth() {
	t := time.NewTimer(closeGrace)
	defer t.Stop()
	// The read that saw EOF gave its credit back: all streamWindow of
	// them are back once every frame sent is acknowledged.
	for acked := 0; acked < streamWindow; {
		select {
		case <-s.credits:
			acked++
		case <-s.peerEOF:
			s.half(true)
			return
		case <-s.dead:
			return
		case <-t.C:
			acked = streamWindow
		}
	}
	select {
	case <-s.peerEOF:
		s.half(true)
	default:
		s.fail("the local end was closed")
	}
}

// hungUp says the local end's peer closed its socket, not only its writes
// (CloseWrite): a unix stream socket polls as hung up only then. A TCP end
// cannot tell (a FIN either way) and is never hung up here.
func hungUp(c io.ReadWriteCloser) bool {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return false
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return false
	}
	hup := false
	rc.Control(func(fd uintptr) {
		p := []unix.PollFd{{Fd: int32(fd)}}
		if n, err := unix.Poll(p, 0); err == nil && n > 0 {
			hup = p[0].Revents&unix.POLLHUP != 0
		}
	})
	return hup
}

func (s *stream) isAborted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.aborted
}

// half records that one direction ended cleanly; both ended ends the
// stream.
func (s *stream) half(read bool) {
	s.mu.Lock()
	if read {
		s.readDone = true
	} else {
		s.writeDone = true
	}
	both := s.readDone && s.writeDone && !s.ended
	if both {
		s.ended = true
	}
	s.mu.Unlock()
	if both {
		s.conn.Close()
		s.finished(s)
	}
}

// fail tells the peer the stream is aborted, then aborts it here.
func (s *stream) fail(why string) {
	if len(why) > 200 {
		why = why[:200]
	}
	s.mu.Lock()
	already := s.aborted || s.ended
	s.mu.Unlock()
	if !already {
		s.send(frameReset, []byte(why))
	}
	s.abort()
}

// abort ends the stream at once: the local end is closed, both loops
// return. A TCP end is reset, but after the peer's close with every byte
// before it written (the reset of a peer whose local end was closed, see
// endBoth): then it is closed as TCP closes, what it was given delivered.
func (s *stream) abort() {
	s.mu.Lock()
	if s.aborted || s.ended {
		s.mu.Unlock()
		return
	}
	s.aborted, s.ended = true, true
	graceful := s.closeSeen && s.written == s.received
	close(s.dead)
	s.mu.Unlock()
	if tc, ok := s.conn.(*net.TCPConn); ok && !graceful {
		tc.SetLinger(0)
	}
	s.conn.Close()
	s.finished(s)
}
