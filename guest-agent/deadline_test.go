package agent

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// hostileAgent is an agent that greets, answers auth and ping (with info),
// takes an exec and never ends it (its output goes on, as a hook's
// background child's would), and never answers a dial. It runs until the
// test ends.
func hostileAgent(t *testing.T, info Info) *Client {
	t.Helper()
	hc, gc := socketpair(t)
	var wmu sync.Mutex
	send := func(ft frameType, id uint32, v any) error {
		b, _ := json.Marshal(v)
		wmu.Lock()
		defer wmu.Unlock()
		_, err := gc.Write(appendFrame(nil, ft, id, b))
		return err
	}
	reply := func(id uint32, result any) {
		b, _ := json.Marshal(result)
		send(frameResponse, id, response{Result: b})
	}
	go func() {
		d := newDecoder(gc)
		for {
			f, err := d.next()
			if err != nil {
				return
			}
			switch f.Type {
			case frameHello:
				send(frameHello, f.ID, helloMsg{Nonce: f.Payload, Version: "hostile"})
			case frameRequest:
				var req request
				json.Unmarshal(f.Payload, &req)
				switch req.Method {
				case methodPing:
					reply(f.ID, info)
				case methodAuth:
					reply(f.ID, authReply{Provisioned: true})
				case methodExec:
					reply(f.ID, nil)
					go func(id uint32) {
						for send(frameStdout, id, "tick\n") == nil {
							time.Sleep(20 * time.Millisecond)
						}
					}(f.ID)
				case methodDial:
					// never answered
				}
			}
		}
	}()
	c := NewClient(hc)
	t.Cleanup(func() { c.Close(); gc.Close() })
	return c
}

// waitReturn runs f and fails the test if it has not returned after a long
// while: without a host-side deadline it never would.
func waitReturn(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("%s never returns", what)
	}
}

// After-clone hooks that never end (a hostile snapshot's agent, or a hook's
// background child that keeps writing) fail at the host's deadline, with
// what they printed.
func TestAfterCloneHooksHostDeadline(t *testing.T) {
	c := hostileAgent(t, Info{Features: []string{FeatureAfterClone, FeatureHookCount}, AfterCloneHooks: 1})
	var err error
	waitReturn(t, "RunAfterCloneHooks", func() { _, err = c.RunAfterCloneHooks(context.Background(), 300*time.Millisecond) })
	var de *HooksDeadlineError
	if !errors.As(err, &de) || de.After != 300*time.Millisecond || !strings.Contains(de.Output, "tick") {
		t.Fatalf("hooks past the host's deadline: %v, want a HooksDeadlineError with their output", err)
	}
	if !strings.Contains(err.Error(), "did not end within 300ms") {
		t.Errorf("message: %v", err)
	}
	// A caller's own end is the caller's, not the deadline's.
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	waitReturn(t, "RunAfterCloneHooks", func() { _, err = c.RunAfterCloneHooks(ctx, time.Hour) })
	if !errors.Is(err, context.Canceled) || errors.As(err, &de) {
		t.Errorf("hooks cancelled by the caller: %v", err)
	}
}

// A dial the guest never answers fails at the forwarder's deadline, and
// leaves nothing behind: no pending answer, no stream.
func TestForwardDialDeadline(t *testing.T) {
	c := hostileAgent(t, Info{Capabilities: Capabilities{Forward: true}})
	f, err := c.Forward(tctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if f.DialDeadline != DefaultDialDeadline {
		t.Errorf("DialDeadline %v, want %v by default", f.DialDeadline, DefaultDialDeadline)
	}
	f.DialDeadline = 200 * time.Millisecond
	const n = 20
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		mine, _ := localPair(t)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = f.Connect(context.Background(), "127.0.0.1:80", mine)
		}()
	}
	waitReturn(t, "Connect", wg.Wait)
	for i, err := range errs {
		var de *DialDeadlineError
		if !errors.As(err, &de) || de.Address != "127.0.0.1:80" {
			t.Fatalf("dial %d to a silent guest: %v, want a DialDeadlineError", i, err)
		}
	}
	f.mu.Lock()
	left := len(f.pending) + len(f.streams)
	f.mu.Unlock()
	if left != 0 {
		t.Errorf("%d dials left pending or streams open", left)
	}
}
