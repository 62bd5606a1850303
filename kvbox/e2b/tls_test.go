package e2b

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"strings"
	"testing"

	"kvbox.dev/kvbox/statedir"
)

// --tls makes a CA for the host and sandbox domain (made once, its key
// root's only), and serves a certificate of it that clients trusting the
// CA accept for the domain, every PORT-ID host under it and the loopback
// addresses; the CA signs nothing else, and a client that does not trust
// it refuses.
func TestTLSOfTheHostCA(t *testing.T) {
	l := statedir.Layout{Root: t.TempDir()}
	cfg, caPath, err := TLS{Auto: true}.config(l, "kvbox.localhost:3049")
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(caKeyPath(l, "kvbox.localhost")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the CA's key: %v %v, want 0600", fi, err)
	}
	_, caPath2, err := TLS{Auto: true}.config(l, "kvbox.localhost:3050")
	if err != nil || caPath2 != caPath {
		t.Fatalf("a second serve of the domain: %s %v, want the same CA %s", caPath2, err, caPath)
	}
	pem, err := os.ReadFile(caPath)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatal("the CA certificate is not PEM")
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) }))
	dial := func(name string, roots *x509.CertPool) error {
		c, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{ServerName: name, RootCAs: roots})
		if err == nil {
			c.Close()
		}
		return err
	}
	for _, name := range []string{"kvbox.localhost", "8000-abcdefghij0123456789.kvbox.localhost", "49983-abcdefghij0123456789.kvbox.localhost", "127.0.0.1"} {
		if err := dial(name, pool); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	for _, name := range []string{"example.com", "a.b.kvbox.localhost", "kvbox.localhost.example.com"} {
		if err := dial(name, pool); err == nil {
			t.Errorf("%s was accepted: the certificate covers only the domain and its PORT-ID hosts", name)
		}
	}
	if err := dial("kvbox.localhost", x509.NewCertPool()); err == nil {
		t.Error("a client that does not trust the CA accepted it")
	}
	// The CA itself cannot sign for another name: its name constraints.
	ca, key, err := ensureCA(l, "kvbox.localhost")
	if err != nil {
		t.Fatal(err)
	}
	other := &leafIssuer{host: "example.com", ca: ca, key: key}
	c, err := other.get(nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Leaf.Verify(x509.VerifyOptions{DNSName: "example.com", Roots: pool})
	if err == nil || !strings.Contains(err.Error(), "constraint") {
		t.Errorf("a certificate of the CA for example.com verified: %v", err)
	}
}

// The certificate options refuse what does not go together, and a domain
// a certificate cannot name.
func TestTLSOptions(t *testing.T) {
	l := statedir.Layout{Root: t.TempDir()}
	for _, c := range []struct {
		tls    TLS
		domain string
	}{
		{TLS{Auto: true, CertFile: "c.pem", KeyFile: "k.pem"}, "kvbox.localhost"},
		{TLS{CertFile: "c.pem"}, "kvbox.localhost"},
		{TLS{CertFile: "/nonexistent/c.pem", KeyFile: "/nonexistent/k.pem"}, "kvbox.localhost"},
		{TLS{Auto: true}, "127.0.0.1:3049"},
		{TLS{Auto: true}, "*.kvbox.localhost"},
	} {
		if _, _, err := c.tls.config(l, c.domain); err == nil {
			t.Errorf("%+v for %s: no error", c.tls, c.domain)
		}
	}
}
