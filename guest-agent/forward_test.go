package agent

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// listen starts a TCP server on loopback that runs serve for each
// connection.
func listen(t *testing.T, serve func(*net.TCPConn)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go serve(c.(*net.TCPConn))
		}
	}()
	return l.Addr().String()
}

// localPair returns both ends of a loopback TCP connection: the one the
// forwarder gets and the one the test drives.
func localPair(t *testing.T) (mine, theirs *net.TCPConn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ch := make(chan net.Conn)
	go func() { c, _ := l.Accept(); ch <- c }()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s := <-ch
	t.Cleanup(func() { c.Close(); s.Close() })
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

func forwarder(t *testing.T) *Forwarder {
	t.Helper()
	c := start(t, testServer(t))
	f, err := c.Forward(tctx(t))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// echo copies what it reads back, then half-closes.
func echo(c *net.TCPConn) {
	io.Copy(c, c)
	c.CloseWrite()
	c.Close()
}

func TestForwardManyStreamsWithHalfClose(t *testing.T) {
	addr := listen(t, echo)
	f := forwarder(t)
	const n = 20
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine, theirs := localPair(t)
			ended, err := f.Connect(tctx(t), addr, theirs)
			if err != nil {
				errs <- err
				return
			}
			data := make([]byte, 256<<10+i*1000)
			rand.Read(data)
			go func() { mine.Write(data); mine.CloseWrite() }()
			got, err := io.ReadAll(mine)
			if err != nil || !bytes.Equal(got, data) {
				errs <- errors.New("echo differs")
				return
			}
			select {
			case <-ended:
			case <-time.After(5 * time.Second):
				errs <- errors.New("stream did not end after both closes")
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	f.mu.Lock()
	left := len(f.streams)
	f.mu.Unlock()
	if left != 0 {
		t.Errorf("%d streams left on the host side", left)
	}
}

// A server that answers only after the client's EOF: half-close must carry
// the EOF and keep the other direction open.
func TestForwardHalfCloseThenAnswer(t *testing.T) {
	addr := listen(t, func(c *net.TCPConn) {
		b, _ := io.ReadAll(c)
		sum := sha256.Sum256(b)
		c.Write(sum[:])
		c.Close()
	})
	f := forwarder(t)
	mine, theirs := localPair(t)
	if _, err := f.Connect(tctx(t), addr, theirs); err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 1<<20)
	rand.Read(data)
	mine.Write(data)
	mine.CloseWrite()
	got, err := io.ReadAll(mine)
	want := sha256.Sum256(data)
	if err != nil || !bytes.Equal(got, want[:]) {
		t.Fatalf("got %x, %v; want %x", got, err, want)
	}
}

// One stream whose local reader never reads must not stall the others, and
// what it buffers stays bounded by the window.
func TestForwardSlowStreamDoesNotStallOthers(t *testing.T) {
	// The guest side server floods its client.
	flood := listen(t, func(c *net.TCPConn) {
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				c.Close()
				return
			}
		}
	})
	addr := listen(t, echo)
	f := forwarder(t)
	slow, theirs := localPair(t)
	if _, err := f.Connect(tctx(t), flood, theirs); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // let the flood fill every buffer
	var m0 runtime.MemStats
	runtime.ReadMemStats(&m0)
	for i := range 5 {
		mine, theirs := localPair(t)
		if _, err := f.Connect(tctx(t), addr, theirs); err != nil {
			t.Fatal(err)
		}
		data := bytes.Repeat([]byte{byte(i)}, 100<<10)
		go func() { mine.Write(data); mine.CloseWrite() }()
		mine.SetReadDeadline(time.Now().Add(20 * time.Second)) // a stall, not a speed
		got, err := io.ReadAll(mine)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("stream %d beside a stalled one: %d bytes, %v", i, len(got), err)
		}
	}
	var m1 runtime.MemStats
	runtime.ReadMemStats(&m1)
	if grow := int64(m1.HeapInuse) - int64(m0.HeapInuse); grow > 16<<20 {
		t.Errorf("heap grew %d MB while one stream stalled", grow>>20)
	}
	// The stalled stream still works once read: 16 MiB, each read within
	// 10 s of the last (a stall, not a speed: a loaded machine, with
	// TestVM's QEMU beside it, is slow but moves).
	buf := make([]byte, 64<<10)
	for n := 0; n < 16<<20; {
		slow.SetReadDeadline(time.Now().Add(10 * time.Second))
		m, err := slow.Read(buf)
		if err != nil {
			t.Fatalf("stalled stream after reading resumed, %d bytes in: %v", n, err)
		}
		n += m
	}
}

func TestForwardDialRefused(t *testing.T) {
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := l.Addr().String()
	l.Close()
	f := forwarder(t)
	_, theirs := localPair(t)
	_, err := f.Connect(tctx(t), addr, theirs)
	var re *RemoteError
	if !errors.As(err, &re) {
		t.Fatalf("dial of a closed port: %v", err)
	}
	// The forwarder goes on.
	addr2 := listen(t, echo)
	mine, theirs2 := localPair(t)
	if _, err := f.Connect(tctx(t), addr2, theirs2); err != nil {
		t.Fatal(err)
	}
	mine.Write([]byte("hi"))
	mine.CloseWrite()
	if b, _ := io.ReadAll(mine); string(b) != "hi" {
		t.Fatalf("got %q", b)
	}
}

// A reset on the guest side (the server aborts) reaches the host's end.
func TestForwardResetPropagates(t *testing.T) {
	addr := listen(t, func(c *net.TCPConn) {
		c.Read(make([]byte, 10))
		c.SetLinger(0)
		c.Close()
	})
	f := forwarder(t)
	mine, theirs := localPair(t)
	ended, err := f.Connect(tctx(t), addr, theirs)
	if err != nil {
		t.Fatal(err)
	}
	mine.Write([]byte("x"))
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("stream not ended by the guest's reset")
	}
	mine.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(mine); err == nil {
		t.Log("host end saw EOF rather than a reset") // either ends it
	}
}

// The connection going away ends the forwarder and its streams.
func TestForwardConnectionLost(t *testing.T) {
	addr := listen(t, echo)
	hc, gc := socketpair(t)
	s := testServer(t)
	go s.ServeConn(t.Context(), gc)
	c := NewClient(hc)
	f, err := c.Forward(tctx(t))
	if err != nil {
		t.Fatal(err)
	}
	mine, theirs := localPair(t)
	ended, err := f.Connect(tctx(t), addr, theirs)
	if err != nil {
		t.Fatal(err)
	}
	gc.Close()
	select {
	case <-f.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("forwarder did not end")
	}
	<-ended
	mine.SetReadDeadline(time.Now().Add(5 * time.Second))
	io.ReadAll(mine)
	f.Close()
}

func TestGuestAddress(t *testing.T) {
	for in, want := range map[string]string{"8000": "127.0.0.1:8000", "10.0.0.2:80": "10.0.0.2:80", "[::1]:22": "[::1]:22"} {
		if got, err := guestAddress(in); err != nil || got != want {
			t.Errorf("%q: %q, %v", in, got, err)
		}
	}
	for _, in := range []string{"", "x", "a:b:c"} {
		if _, err := guestAddress(in); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}

// An agent from before streams (no Forward capability, no "dial" method):
// Forward says so instead of sending frames it would drop as garbage.
func TestForwardOldAgent(t *testing.T) {
	hc, gc := socketpair(t)
	go func() { // a minimal old agent: HELLO and ping only
		d := newDecoder(gc)
		for {
			f, err := d.next()
			if err != nil {
				return
			}
			switch f.Type {
			case frameHello:
				b, _ := json.Marshal(helloMsg{Nonce: f.Payload, Version: "0.1.0"})
				gc.Write(appendFrame(nil, frameHello, f.ID, b))
			case frameRequest:
				var req request
				json.Unmarshal(f.Payload, &req)
				resp := response{Error: fmt.Sprintf("unknown method %q", req.Method)}
				if req.Method == methodPing {
					resp = response{Result: mustJSON(Info{Version: "0.1.0", Capabilities: Capabilities{Exec: true}})}
				}
				b, _ := json.Marshal(resp)
				gc.Write(appendFrame(nil, frameResponse, f.ID, b))
			}
		}
	}()
	c := NewClient(hc)
	defer c.Close()
	_, err := c.Forward(tctx(t))
	if !errors.Is(err, ErrNoForward) || !strings.Contains(err.Error(), "0.1.0") {
		t.Fatalf("Forward on an old agent: %v", err)
	}
	// The connection still serves calls.
	if _, err := c.Ping(tctx(t)); err != nil {
		t.Fatalf("ping after the refusal: %v", err)
	}
}
