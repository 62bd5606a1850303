package main

import (
	"context"
	"fmt"
	"log"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/kvbox/e2b"
)

type serveOptions struct {
	listen string
	domain string
	tls    e2b.TLS
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
	c.Flags().StringVar(&o.listen, "listen", "127.0.0.1:3049", "address to listen on (plain HTTP unless --tls or --tls-cert: keep it on loopback, or serve TLS)")
	c.Flags().BoolVar(&o.tls.Auto, "tls", false, "serve HTTPS with a certificate of a CA kvbox makes for this host and sandbox domain (STATE_DIR/serve/tls/DOMAIN/ca.crt: give it to the clients to trust)")
	c.Flags().StringVar(&o.tls.CertFile, "tls-cert", "", "serve HTTPS with this certificate (PEM; for the sandbox domain and *.DOMAIN), with --tls-key")
	c.Flags().StringVar(&o.tls.KeyFile, "tls-key", "", "the private key (PEM) of --tls-cert")
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
			key, _, err := e2b.Key(a.layout())
			if err != nil {
				return err
			}
			fmt.Fprintln(a.io.Out, key)
			return nil
		},
	})
	return c
}

func (a *app) runServe(ctx context.Context, o *serveOptions) error {
	k, err := a.lib()
	if err != nil {
		return err
	}
	err = e2b.Run(ctx, k, e2b.Options{Listen: o.listen, Domain: o.domain, TLS: o.tls, Log: log.New(a.io.Err, "kvbox serve: ", log.LstdFlags),
		Ready: func(at e2b.Listening) {
			if at.KeyMade {
				fmt.Fprintf(a.io.Err, "made the API key in %s (kvbox serve key prints it)\n", e2b.KeyPath(a.layout()))
			}
			if !at.Addr.IP.IsLoopback() && !o.tls.On() {
				fmt.Fprintf(a.io.Err, "warning: %s is not a loopback address: the API and every sandbox's traffic go over plain HTTP; serve TLS (--tls, --tls-cert)\n", at.Addr)
			}
			if at.CACert != "" {
				fmt.Fprintf(a.io.Err, "kvbox serve: TLS with a certificate of the CA %s (clients trust it: NODE_EXTRA_CA_CERTS, SSL_CERT_FILE)\n", at.CACert)
			}
			fmt.Fprintf(a.io.Out, "kvbox serve: E2B's API on %s (state dir %s, sandbox domain %s)\n", at.URL, a.stateDir, at.Domain)
			fmt.Fprintf(a.io.Out, "  E2B_API_URL=%s E2B_SANDBOX_URL=%s E2B_API_KEY=$(kvbox serve key)\n", at.URL, at.URL)
		}})
	if err == nil {
		fmt.Fprintln(a.io.Err, "kvbox serve: stopped; the sandboxes run on")
	}
	return err
}
