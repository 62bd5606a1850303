package egress

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"os"
	"sync"
	"time"
)

// A TLS connection to a name with a header transform is terminated by the
// proxy with a certificate of the host's egress CA for that name alone
// (every other name passes untouched), its requests get the transform's
// headers, their secrets read from the host's store at each request, and
// go on over TLS to the name as the proxy's resolver answers it. The
// box's requests are HTTP/1.1 (the proxy offers no other protocol).

// interceptState is what the TLS-terminating path shares.
type interceptState struct {
	once      sync.Once
	issuer    *issuer
	transport *http.Transport
	err       error
}

func (p *Proxy) intercepting() (*interceptState, error) {
	p.mu.Lock()
	if p.ic == nil {
		p.ic = &interceptState{}
	}
	ic := p.ic
	p.mu.Unlock()
	ic.once.Do(func() {
		roots, err := x509.SystemCertPool()
		if err != nil {
			roots = x509.NewCertPool()
		}
		if p.UpstreamCAFile != "" {
			b, err := os.ReadFile(p.UpstreamCAFile)
			if err != nil || !roots.AppendCertsFromPEM(b) {
				ic.err = fmt.Errorf("upstream CA %s: not read (%v)", p.UpstreamCAFile, err)
				return
			}
		}
		if p.UpstreamRoots != nil {
			roots = p.UpstreamRoots
		}
		ic.issuer = &issuer{root: p.StateDir}
		ic.transport = &http.Transport{
			DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
				host, _, err := net.SplitHostPort(addr)
				if err != nil {
					return nil, err
				}
				return p.dial(ctx, host, p.upstreamPort(p.UpstreamTLS, 443))
			},
			TLSClientConfig:     &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
			TLSHandshakeTimeout: 15 * time.Second,
			IdleConnTimeout:     90 * time.Second,
		}
	})
	return ic, ic.err
}

// intercept serves the box's TLS connection to name (hello already read)
// as that name, setting the policy's headers on each request.
func (p *Proxy) intercept(c net.Conn, b Box, name string, hello []byte) {
	ic, err := p.intercepting()
	if err != nil {
		p.refuse(b, "tls", "%s: %v", name, err)
		return
	}
	cert, err := ic.issuer.cert(name)
	if err != nil {
		p.refuse(b, "tls", "%s: no certificate: %v", name, err)
		return
	}
	tc := tls.Server(&replayConn{Conn: c, r: io.MultiReader(bytes.NewReader(hello), c)},
		&tls.Config{Certificates: []tls.Certificate{*cert}, NextProtos: []string{"http/1.1"}, MinVersion: tls.VersionTLS12})
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(&url.URL{Scheme: "https", Host: name})
		},
		Transport:     &transformer{p: p, addr: b.Addr, name: name, rt: ic.transport},
		FlushInterval: -1,
		ErrorLog:      p.Log,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			p.logf("%s (%s) to %s: %v", b.Name, b.Addr, name, err)
			http.Error(w, "kvbox egress proxy: "+err.Error(), http.StatusBadGateway)
		},
	}
	l := newOneConnListener(tc)
	srv := &http.Server{Handler: rp, ReadHeaderTimeout: 30 * time.Second, ErrorLog: p.Log}
	srv.Serve(l)
}

// transformer sets a request's headers from the box's policy as it is
// now (read at each request), then sends it.
type transformer struct {
	p    *Proxy
	addr netip.Addr
	name string
	rt   http.RoundTripper
}

func (t *transformer) RoundTrip(r *http.Request) (*http.Response, error) {
	b, err := ReadBox(t.p.StateDir, t.addr)
	if err != nil {
		return nil, fmt.Errorf("no policy for %s any more", t.addr)
	}
	c, err := b.Policy.Compile()
	if err != nil || !c.AllowsName(t.name) {
		t.p.refuse(b, "tls", "%s: not a name the policy allows", t.name)
		return nil, fmt.Errorf("%s is not allowed any more", t.name)
	}
	for _, h := range b.Policy.HeadersFor(t.name) {
		v, err := h.Resolve(t.p.StateDir)
		if err != nil {
			t.p.refuse(b, "tls", "%s: header %s: %v", t.name, h.Name, err)
			return nil, fmt.Errorf("header %s: %v", h.Name, err)
		}
		r.Header.Set(h.Name, v)
	}
	return t.rt.RoundTrip(r)
}

// replayConn reads what was peeked first.
type replayConn struct {
	net.Conn
	r io.Reader
}

func (c *replayConn) Read(b []byte) (int, error) { return c.r.Read(b) }

// oneConnListener hands out one connection, then waits for it to close.
type oneConnListener struct {
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
	addr net.Addr
}

func newOneConnListener(c net.Conn) *oneConnListener {
	l := &oneConnListener{ch: make(chan net.Conn, 1), done: make(chan struct{}), addr: c.LocalAddr()}
	l.ch <- &notifyConn{Conn: c, l: l}
	return l
}

func (l *oneConnListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *oneConnListener) Close() error   { l.once.Do(func() { close(l.done) }); return nil }
func (l *oneConnListener) Addr() net.Addr { return l.addr }

type notifyConn struct {
	net.Conn
	l *oneConnListener
}

func (c *notifyConn) Close() error { err := c.Conn.Close(); c.l.Close(); return err }
