package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/serve"
)

type serveOptions struct {
	listen string
	domain string
}

func (a *app) newCmdServe() *cobra.Command {
	o := &serveOptions{}
	c := &cobra.Command{
		Use:   "serve",
		Short: "Serve E2B's API: agent code written for E2B runs on warm kvbox clones",
		Long: `Serve E2B's API on one HTTP listener (loopback unless told otherwise), so that
code written for E2B's SDKs runs unchanged on this host: a template is a kvbox
snapshot, a sandbox a warm clone of it.

  E2B_API_URL=http://127.0.0.1:3049 E2B_SANDBOX_URL=http://127.0.0.1:3049 \
  E2B_API_KEY=$(kvbox serve key) node agent.mjs

kvbox serve runs in the foreground and keeps nothing but what libvirt keeps
and the sandboxes' secrets (root's only, under the state dir): stop it and
start it again at any time. Sandboxes run on while it is down, and are removed
at their timeout all the same. docs/e2b.md says what is supported.`,
		Example: `  kvbox snapshots new dev warm      # the template
  kvbox serve key                   # the API key (made on first use)
  kvbox serve --listen 127.0.0.1:3049`,
		Args: exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, args []string) error { return a.runServe(c.Context(), o) },
	}
	c.Flags().StringVar(&o.listen, "listen", "127.0.0.1:3049", "address to listen on (plain HTTP: keep it on loopback, or put a TLS proxy in front)")
	c.Flags().StringVar(&o.domain, "domain", "", "sandbox domain given to the SDKs: getHost(PORT) is PORT-ID.DOMAIN, routed by Host (default kvbox.localhost:LISTENPORT)")
	c.AddCommand(&cobra.Command{
		Use:     "key",
		Short:   "Print kvbox serve's API key (E2B_API_KEY), making it on first use",
		Example: "  export E2B_API_KEY=$(kvbox serve key)",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, args []string) error {
			if err := a.absPaths(); err != nil {
				return err
			}
			key, _, err := a.serveKey()
			if err != nil {
				return err
			}
			fmt.Fprintln(a.io.Out, key)
			return nil
		},
	})
	return c
}

// serveDir is kvbox serve's folder under the state dir: its API key, its
// lock, the sandboxes' secrets. Root's only.
func (a *app) serveDir() string { return a.layout().Serve() }

var apiKeyRe = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

// serveKey reads the API key, or makes one (e2b_ and 40 hex digits: every
// SDK version's check takes it) root's only; made says it was made now.
func (a *app) serveKey() (key string, made bool, err error) {
	if os.Geteuid() != 0 {
		return "", false, base.Errorf(base.Unavailable, "kvbox serve's key is root's: run it as root")
	}
	dir := a.serveDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", false, err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return "", false, err
	}
	path := filepath.Join(dir, "api-key")
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err == nil {
		defer f.Close()
		if err := f.Chmod(0o600); err != nil {
			return "", false, err
		}
		b, err := io.ReadAll(io.LimitReader(f, 256))
		if err != nil {
			return "", false, err
		}
		key := strings.TrimSpace(string(b))
		if !apiKeyRe.MatchString(key) {
			return "", false, base.Errorf(base.Invalid, "%s does not hold an API key (e2b_ and 40 hex digits): remove it and kvbox serve key makes one", path)
		}
		return key, false, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return "", false, err
	}
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		return "", false, err
	}
	key = "e2b_" + hex.EncodeToString(b)
	if err := overlay.WriteFileAtomic(path, []byte(key+"\n"), 0o600); err != nil {
		return "", false, err
	}
	return key, true, nil
}

func (a *app) runServe(ctx context.Context, o *serveOptions) error {
	k, err := a.lib()
	if err != nil {
		return err
	}
	// A host libvirt cannot describe fails here, not at the first request.
	if _, err := k.HostCompat(ctx); err != nil {
		return err
	}
	key, made, err := a.serveKey()
	if err != nil {
		return err
	}
	lock, err := base.Lock(filepath.Join(a.serveDir(), "lock"), false)
	if err != nil {
		return base.Errorf(base.Busy, "another kvbox serve runs on state dir %s (%v)", a.stateDir, err)
	}
	defer lock.Unlock()
	l, err := net.Listen("tcp", o.listen)
	if err != nil {
		return usage("--listen %s: %v", o.listen, err)
	}
	defer l.Close()
	addr := l.Addr().(*net.TCPAddr)
	dom := o.domain
	if dom == "" {
		dom = fmt.Sprintf("kvbox.localhost:%d", addr.Port)
	}
	logger := log.New(a.io.Err, "kvbox serve: ", log.LstdFlags)
	srv, err := serve.New(ctx, serve.Config{Host: serveHost{k}, APIKey: key, Domain: dom, SecretsDir: filepath.Join(a.serveDir(), "sandboxes"), Log: logger})
	if err != nil {
		return err
	}
	defer srv.Close()
	pctx, stop := context.WithCancel(ctx)
	defer stop()
	go srv.Prune(pctx, 30*time.Second)
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 640 * time.Second,
		ErrorLog: log.New(io.Discard, "", 0)}
	url := "http://" + addr.String()
	if made {
		fmt.Fprintf(a.io.Err, "made the API key in %s (kvbox serve key prints it)\n", filepath.Join(a.serveDir(), "api-key"))
	}
	if !addr.IP.IsLoopback() {
		fmt.Fprintf(a.io.Err, "warning: %s is not a loopback address: the API and every sandbox's traffic go over plain HTTP; put a TLS proxy in front\n", addr)
	}
	fmt.Fprintf(a.io.Out, "kvbox serve: E2B's API on %s (state dir %s, sandbox domain %s)\n", url, a.stateDir, dom)
	fmt.Fprintf(a.io.Out, "  E2B_API_URL=%s E2B_SANDBOX_URL=%s E2B_API_KEY=$(kvbox serve key)\n", url, url)
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	hs.Shutdown(sctx)
	hs.Close()
	fmt.Fprintln(a.io.Err, "kvbox serve: stopped; the sandboxes run on")
	return nil
}
