package agent

import (
	"errors"
	"io"
	"net"
	"sync"
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

	mu        sync.Mutex
	readDone  bool // we sent close (or the stream was aborted)
	writeDone bool // the peer's close was applied (or aborted)
	aborted   bool
	ended     bool
}

func newStream(id uint32, conn io.ReadWriteCloser, send func(frameType, []byte) error, finished func(*stream)) *stream {
	s := &stream{id: id, conn: conn, send: send, finished: finished,
		credits: make(chan struct{}, streamWindow),
		in:      make(chan frame, streamWindow+1),
		dead:    make(chan struct{}),
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
			if s.isAborted() || s.send(frameClose, nil) != nil {
				s.abort()
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
		if s.send(frameDataAck, nil) != nil {
			s.abort()
			return
		}
	}
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

// abort ends the stream at once: the local end is closed (reset for TCP),
// both loops return.
func (s *stream) abort() {
	s.mu.Lock()
	if s.aborted || s.ended {
		s.mu.Unlock()
		return
	}
	s.aborted, s.ended = true, true
	close(s.dead)
	s.mu.Unlock()
	if tc, ok := s.conn.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	s.conn.Close()
	s.finished(s)
}
