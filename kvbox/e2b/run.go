package e2b

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"path/filepath"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/serve"
	"kvbox.dev/kvbox/statedir"
)

// Options say where kvbox serve listens and what it tells.
type Options struct {
	// Listen is the TCP address of the one listener.
	Listen string
	// Domain is the sandbox domain given to the SDKs
	// (kvbox.localhost:LISTENPORT when empty).
	Domain string
	// TLS, when on, makes the listener HTTPS.
	TLS TLS
	// Log gets serve's line per sandbox change and per failure.
	Log *log.Logger
	// Ready is told, once, what Run listens on.
	Ready func(Listening)
}

// Listening is what Run serves on.
type Listening struct {
	// Addr is the listener's address; URL is it as the SDKs are given it.
	Addr *net.TCPAddr
	URL  string
	// Domain is the sandbox domain.
	Domain string
	// KeyMade says the API key was made now, in KeyPath.
	KeyMade bool
	// CACert is the certificate of the CA kvbox made for the host's TLS
	// (Options.TLS.Auto), which clients trust; "" otherwise.
	CACert string
}

// Run serves E2B's API for the library's host k until ctx ends (nil then:
// the sandboxes run on). One kvbox serve runs on a state dir at a time; a
// host libvirt cannot describe fails here, not at the first request.
func Run(ctx context.Context, k *kvbox.Host, o Options) error {
	if _, err := k.HostCompat(ctx); err != nil {
		return err
	}
	l := statedir.Layout{Root: k.StateDir()}
	key, made, err := Key(l)
	if err != nil {
		return err
	}
	lock, err := base.Lock(filepath.Join(l.Serve(), "lock"), false)
	if err != nil {
		return base.Errorf(base.Busy, "another kvbox serve runs on state dir %s (%v)", k.StateDir(), err)
	}
	defer lock.Unlock()
	ln, err := net.Listen("tcp", o.Listen)
	if err != nil {
		return base.Errorf(base.Invalid, "--listen %s: %v", o.Listen, err)
	}
	defer ln.Close()
	at := Listening{Addr: ln.Addr().(*net.TCPAddr), Domain: o.Domain, KeyMade: made}
	at.URL = "http://" + at.Addr.String()
	if at.Domain == "" {
		at.Domain = fmt.Sprintf("kvbox.localhost:%d", at.Addr.Port)
	}
	var tc *tls.Config
	if o.TLS.On() {
		if tc, at.CACert, err = o.TLS.config(l, at.Domain); err != nil {
			return err
		}
		at.URL = "https://" + at.Addr.String()
	}
	srv, err := serve.New(ctx, serve.Config{Host: Host(k), APIKey: key, Domain: at.Domain,
		SecretsDir: filepath.Join(l.Serve(), "sandboxes"), Log: o.Log})
	if err != nil {
		return err
	}
	defer srv.Close()
	if o.Ready != nil {
		o.Ready(at)
	}
	return serveHTTP(ctx, srv, ln, tc)
}

// serveHTTP serves srv on ln (over TLS with tc, HTTP/2 offered beside
// HTTP/1.1 as E2B's own endpoints do), and prunes its sandboxes' secrets,
// until ctx ends.
func serveHTTP(ctx context.Context, srv *serve.Server, ln net.Listener, tc *tls.Config) error {
	pctx, stop := context.WithCancel(ctx)
	defer stop()
	go srv.Prune(pctx, 30*time.Second)
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 640 * time.Second,
		ErrorLog: log.New(io.Discard, "", 0), TLSConfig: tc}
	errc := make(chan error, 1)
	go func() {
		if tc != nil {
			errc <- hs.ServeTLS(ln, "", "")
			return
		}
		errc <- hs.Serve(ln)
	}()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	hs.Shutdown(sctx)
	hs.Close()
	return nil
}
