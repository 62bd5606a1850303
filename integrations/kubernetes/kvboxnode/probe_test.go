package kvboxnode

import (
	"bufio"
	"context"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// guestServer is a guest's HTTP server behind the agent: each connection
// reads the request, then gets answer (a function of the writer). sent
// counts the bytes the guest got to write, which is what the probe read
// (a pipe's write returns once it was read); done gets a value once the
// answer ended (the probe closed its connection).
func guestServer(sent *atomic.Int64, done chan<- struct{}, answer func(w *countWriter)) func(string) (net.Conn, error) {
	return func(target string) (net.Conn, error) {
		host, guest := net.Pipe()
		go func() {
			defer func() { done <- struct{}{} }()
			defer guest.Close()
			if _, err := http.ReadRequest(bufio.NewReader(guest)); err != nil {
				return
			}
			answer(&countWriter{c: guest, n: sent})
		}()
		return host, nil
	}
}

type countWriter struct {
	c net.Conn
	n *atomic.Int64
}

func (w *countWriter) Write(b []byte) (int, error) {
	n, err := w.c.Write(b)
	w.n.Add(int64(n))
	return n, err
}

// A guest that answers an httpGet probe with one header line of 8 MiB:
// the probe fails, having read no more than its bound of the answer; an
// honest answer still passes.
func TestProbeHTTPBoundsAnswer(t *testing.T) {
	lib := newFakeLib()
	p, cancel := testProvider(t, lib, &apiPods{})
	defer cancel()
	pod := testPod("web", "u1")
	probe := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromInt32(8080)}}}
	var sent atomic.Int64
	done := make(chan struct{}, 1)
	lib.dial = guestServer(&sent, done, func(w *countWriter) {
		w.Write([]byte("HTTP/1.1 200 OK\r\nX-Big: "))
		chunk := []byte(strings.Repeat("a", 64<<10))
		for i := 0; i < 128; i++ { // 8 MiB of one header line
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
		w.Write([]byte("\r\nContent-Length: 0\r\n\r\n"))
	})
	// The test's deadline is far: what ends the probe is its bound, not time.
	if p.probe(context.Background(), "box", "172.31.0.9", pod, nil, probe, time.Hour) {
		t.Error("a probe answered with an 8 MiB header passed")
	}
	<-done
	if n := sent.Load(); n > maxProbeHeaderBytes+maxProbeBodyBytes+64<<10 {
		t.Errorf("the probe read %d bytes of the guest's answer; its bound is %d (and one chunk of the guest's writes)", n, maxProbeHeaderBytes+maxProbeBodyBytes)
	}

	// A body without end is read to its bound, and the status passes.
	sent.Store(0)
	lib.dial = guestServer(&sent, done, func(w *countWriter) {
		w.Write([]byte("HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n"))
		chunk := []byte(strings.Repeat("b", 4<<10))
		for i := 0; i < 1<<18; i++ {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	})
	if !p.probe(context.Background(), "box", "172.31.0.9", pod, nil, probe, time.Hour) {
		t.Error("a 200 with an endless body failed")
	}
	<-done
	if n := sent.Load(); n > maxProbeHeaderBytes+maxProbeBodyBytes+4<<10 {
		t.Errorf("the probe read %d bytes of an endless body; its bound is %d", n, maxProbeBodyBytes)
	}
}
