package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// setStreamCaps makes one session's stream cap, and the part of it kept
// for envd, small for a test.
func setStreamCaps(t *testing.T, total, envd int) {
	t.Helper()
	oldTotal, oldEnvd := maxStreams, envdStreams
	maxStreams, envdStreams = total, envd
	t.Cleanup(func() { maxStreams, envdStreams = oldTotal, oldEnvd })
}

// holdDials makes the agent's guest dials wait until release is called;
// entered counts the dials that reached it.
func holdDials(t *testing.T) (entered *atomic.Int32, release func()) {
	t.Helper()
	entered = new(atomic.Int32)
	gate := make(chan struct{})
	old := dialGuest
	dialGuest = func(addr string) (net.Conn, error) {
		entered.Add(1)
		<-gate
		return old(addr)
	}
	var released atomic.Bool
	release = func() {
		if released.CompareAndSwap(false, true) {
			close(gate)
		}
	}
	t.Cleanup(func() { release(); dialGuest = old })
	return entered, release
}

// refusedForCap says err is the agent refusing a dial for its stream cap.
func refusedForCap(err error) bool {
	var re *RemoteError
	return errors.As(err, &re) && strings.Contains(re.Message, "streams")
}

// waitUntil waits for cond, failing the test with what after a deadline
// that only a stuck run reaches.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

type connected struct {
	mine  *net.TCPConn
	ended <-chan struct{}
	err   error
}

// Dials the host sends all at once are counted as they start, not once
// they are connected: while the first ones are still dialling, those past
// the cap are refused (the agent used to count only connected streams, so
// every dial in flight passed the check).
func TestForwardCapCountsDialsInFlight(t *testing.T) {
	const limit, extra = 3, 5
	setStreamCaps(t, limit, 0)
	addr := listen(t, echo)
	entered, release := holdDials(t)
	f := forwarder(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	results := make(chan connected, limit+extra)
	for range limit + extra {
		mine, theirs := localPair(t)
		go func() {
			ended, err := f.Connect(ctx, addr, theirs)
			results <- connected{mine, ended, err}
		}()
	}
	// With the first dials held, every one past the cap is answered.
	deadline := time.After(10 * time.Second)
	for refused := 0; refused < extra; {
		select {
		case r := <-results:
			if !refusedForCap(r.err) {
				t.Fatalf("a dial past the cap was not refused for it: %v", r.err)
			}
			refused++
		case <-deadline:
			t.Fatalf("%d dials held by the guest at once, none refused: the cap of %d was not counted as they started", entered.Load(), limit)
		}
	}
	waitUntil(t, "the dials within the cap reach the guest", func() bool { return entered.Load() == limit })
	release()
	for range limit {
		r := <-results
		if r.err != nil {
			t.Fatalf("a dial within the cap: %v", r.err)
		}
		r.mine.Write([]byte("ok"))
		r.mine.CloseWrite()
		if b, _ := io.ReadAll(r.mine); string(b) != "ok" {
			t.Fatalf("echo through a stream within the cap: %q", b)
		}
	}
	if n := entered.Load(); n != limit {
		t.Errorf("%d dials reached the guest, cap %d", n, limit)
	}
}

// Streams to the guest's ports cannot take the part of the cap kept for
// envd: with them at their share, the owner's envd is still dialled, and
// only a full cap refuses it.
func TestForwardEnvdKeepsItsShare(t *testing.T) {
	const total, envd = 4, 2
	setStreamCaps(t, total, envd)
	addr := listen(t, echo)
	f := forwarder(t)
	var ports []*net.TCPConn
	for i := range total - envd {
		mine, theirs := localPair(t)
		if _, err := f.Connect(tctx(t), addr, theirs); err != nil {
			t.Fatalf("stream %d to a guest port: %v", i, err)
		}
		ports = append(ports, mine)
	}
	_, theirs := localPair(t)
	if _, err := f.Connect(tctx(t), addr, theirs); !refusedForCap(err) {
		t.Fatalf("a guest port's stream past their share: %v, want refused", err)
	}
	for i := range envd {
		_, theirs := localPair(t)
		if _, err := f.Connect(tctx(t), EnvdDialAddress, theirs); err != nil {
			t.Fatalf("envd stream %d beside the guest ports' full share: %v", i, err)
		}
	}
	_, theirs = localPair(t)
	if _, err := f.Connect(tctx(t), EnvdDialAddress, theirs); !refusedForCap(err) {
		t.Fatalf("an envd stream past the whole cap: %v, want refused", err)
	}
	// A guest port's stream that ends gives its slot back.
	ports[0].CloseWrite()
	io.ReadAll(ports[0])
	waitUntil(t, "a guest port's slot is given back", func() bool {
		_, theirs := localPair(t)
		_, err := f.Connect(tctx(t), addr, theirs)
		return err == nil
	})
}

// holdOpen is a guest server that reads what it is sent until EOF and then
// keeps its side open: it neither writes nor closes until the test ends.
// Each connection it took is sent on the returned channel.
func holdOpen(t *testing.T) (string, <-chan *net.TCPConn) {
	t.Helper()
	conns := make(chan *net.TCPConn, 64)
	addr := listen(t, func(c *net.TCPConn) {
		conns <- c
		io.Copy(io.Discard, c)
		<-t.Context().Done()
		c.Close()
	})
	return addr, conns
}

// A stream whose local end is closed (not half-closed: what an HTTP
// transport does when its request is done or its client went) ends both
// ways, through the agent, although the guest keeps its side open: the
// host's stream, the agent's slot and the guest's socket all go. They used
// to stay half-open for as long as the guest kept its side, until the cap
// refused every dial.
func TestForwardClosedEndEndsStream(t *testing.T) {
	const n = 5
	setStreamCaps(t, n, 0)
	addr, guest := holdOpen(t)
	f := forwarder(t)
	for i := range n {
		mine, theirs, err := SocketPair()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Connect(tctx(t), addr, theirs); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		mine.Write([]byte("GET / HTTP/1.1\r\nHost: box\r\n\r\n"))
		mine.Close()
	}
	waitUntil(t, "the host's streams end", func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.streams) == 0
	})
	// The agent gave every slot back: as many streams again fit the cap.
	for i := range n {
		_, theirs, err := SocketPair()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { theirs.Close() })
		if _, err := f.Connect(tctx(t), addr, theirs); err != nil {
			t.Fatalf("stream %d after the first ones ended: %v", i, err)
		}
	}
	// The guest's sockets of the first streams are closed: what it writes
	// is refused.
	for range n {
		c := <-guest
		waitUntil(t, "the guest's socket of a closed stream is closed", func() bool {
			_, err := c.Write([]byte("late"))
			return err != nil
		})
	}
}

// A unix socket's half-close stays a half-close: the guest answers after
// its EOF and the answer comes back.
func TestForwardUnixHalfCloseStaysOpen(t *testing.T) {
	addr := listen(t, func(c *net.TCPConn) {
		b, _ := io.ReadAll(c)
		c.Write(append([]byte("got "), b...))
		c.Close()
	})
	f := forwarder(t)
	mine, theirs, err := SocketPair()
	if err != nil {
		t.Fatal(err)
	}
	defer mine.Close()
	if _, err := f.Connect(tctx(t), addr, theirs); err != nil {
		t.Fatal(err)
	}
	mine.Write([]byte("question"))
	mine.(interface{ CloseWrite() error }).CloseWrite()
	mine.SetReadDeadline(time.Now().Add(10 * time.Second))
	if b, err := io.ReadAll(mine); err != nil || string(b) != "got question" {
		t.Fatalf("answer after a half-close: %q, %v", b, err)
	}
}

// What was written before a close reaches the guest whole, also when the
// guest reads only after the close, so that the agent still holds bytes
// for it when the stream ends.
func TestForwardCloseDeliversWhatWasWritten(t *testing.T) {
	got := make(chan []byte, 1)
	start := make(chan struct{})
	addr := listen(t, func(c *net.TCPConn) {
		<-start
		b, _ := io.ReadAll(c)
		got <- b
		c.Close()
	})
	f := forwarder(t)
	mine, theirs, err := SocketPair()
	if err != nil {
		t.Fatal(err)
	}
	ended, err := f.Connect(tctx(t), addr, theirs)
	if err != nil {
		t.Fatal(err)
	}
	// A window's worth: the host's stream takes it all without waiting for
	// the guest, so the close comes before the guest reads.
	data := make([]byte, streamWindow*chunkSize)
	rand.Read(data)
	mine.Write(data)
	mine.Close()
	close(start)
	select {
	case b := <-got:
		if !bytes.Equal(b, data) {
			t.Fatalf("the guest read %d bytes of %d, or other bytes", len(b), len(data))
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the guest did not read to the end")
	}
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the stream did not end")
	}
}
