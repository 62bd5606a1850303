package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// fakeDNS answers A queries from names, NXDOMAIN otherwise.
func fakeDNS(t *testing.T, names map[string]string) string {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		if a, ok := names[strings.TrimSuffix(q.Question[0].Name, ".")]; ok && q.Question[0].Qtype == dns.TypeA {
			rr, _ := dns.NewRR(q.Question[0].Name + " 60 IN A " + a)
			m.Answer = append(m.Answer, rr)
		} else if !ok {
			m.Rcode = dns.RcodeNameError
		}
		w.WriteMsg(m)
	})}
	go srv.ActivateAndServe()
	t.Cleanup(func() { srv.Shutdown() })
	return pc.LocalAddr().String()
}

// servers on addr:port that answer with body, over TLS and plain HTTP.
func servers(t *testing.T, addr string, tlsPort, httpPort int, body string) (*httptest.Server, *httptest.Server) {
	t.Helper()
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, body)
		if r.URL.Path == "/host" {
			fmt.Fprint(w, " host="+r.Host)
		}
		if a := r.Header.Get("Authorization"); a != "" {
			fmt.Fprint(w, " auth="+a)
		}
	})
	mk := func(port int, tlsOn bool) *httptest.Server {
		l, err := net.Listen("tcp4", net.JoinHostPort(addr, strconv.Itoa(port)))
		if err != nil {
			t.Fatal(err)
		}
		s := httptest.NewUnstartedServer(h)
		s.Listener = l
		if tlsOn {
			s.StartTLS()
		} else {
			s.Start()
		}
		t.Cleanup(s.Close)
		return s
	}
	return mk(tlsPort, true), mk(httpPort, false)
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

type proxyBench struct {
	p    *Proxy
	root string
	pool *x509.CertPool
}

func startProxy(t *testing.T) proxyBench {
	t.Helper()
	tp, hp := freePort(t), freePort(t)
	allowedTLS, _ := servers(t, "127.0.0.2", tp, hp, "allowed")
	servers(t, "127.0.0.3", tp, hp, "other")
	up := fakeDNS(t, map[string]string{"example.com": "127.0.0.2", "allowed.test": "127.0.0.2", "api.wild.test": "127.0.0.2", "other.test": "127.0.0.3", "wild.test": "127.0.0.3"})
	root := t.TempDir()
	p := &Proxy{StateDir: root, Listen: "127.0.0.1", Upstream: up, UpstreamTLS: uint16(tp), UpstreamHTTP: uint16(hp),
		Reachable: func(netip.Addr) bool { return true }}
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- p.Serve(ctx, func() { close(ready) }) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-ready:
	case err := <-done:
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(allowedTLS.Certificate())
	p.UpstreamRoots = pool
	return proxyBench{p: p, root: root, pool: pool}
}

func (b proxyBench) setPolicy(t *testing.T, s Spec) {
	t.Helper()
	pol, err := s.Policy()
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteBox(b.root, Box{Name: "box1", Addr: netip.MustParseAddr("127.0.0.1"), Policy: pol}); err != nil {
		t.Fatal(err)
	}
}

// viaTLS connects to the proxy's TLS port with sni and GETs / with host.
func (b proxyBench) viaTLS(sni, host string) (string, error) {
	c, err := net.DialTimeout("tcp4", b.p.Addrs().TLS.String(), 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	// httptest's certificate is for example.com and 127.0.0.1: check the
	// chain, not the name (the server reached is what the body tells).
	cfg := &tls.Config{ServerName: sni, InsecureSkipVerify: true}
	tc := tls.Client(c, cfg)
	if err := tc.Handshake(); err != nil {
		return "", err
	}
	return get(tc, host)
}

func (b proxyBench) viaHTTP(host string) (string, error) {
	c, err := net.DialTimeout("tcp4", b.p.Addrs().HTTP.String(), 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	return get(c, host)
}

func get(c io.ReadWriter, host string) (string, error) {
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return string(body), err
}

func TestProxyByName(t *testing.T) {
	b := startProxy(t)
	b.setPolicy(t, Spec{Mode: DenyAll, Allow: []string{"allowed.test", "*.wild.test"}})
	for _, tc := range []struct {
		name      string
		tls       bool
		sni, host string
		want      string // "" for refused
	}{
		{"TLS to an allowed name", true, "allowed.test", "allowed.test", "allowed"},
		{"TLS to a wildcard's name", true, "api.wild.test", "api.wild.test", "allowed"},
		{"TLS to a name not allowed", true, "other.test", "other.test", ""},
		{"TLS to the wildcard's own domain", true, "wild.test", "wild.test", ""},
		{"TLS without SNI", true, "", "allowed.test", ""},
		// The proxy dials the SNI's name: another Host inside reaches the
		// allowed server, never other.test's.
		{"TLS with an allowed SNI and another Host", true, "allowed.test", "other.test", "allowed"},
		{"HTTP to an allowed name", false, "", "allowed.test", "allowed"},
		{"HTTP with a port in Host", false, "", "allowed.test:8080", "allowed"},
		{"HTTP to a wildcard's name", false, "", "API.wild.test.", "allowed"},
		{"HTTP to a name not allowed", false, "", "other.test", ""},
		{"HTTP to an address", false, "", "127.0.0.3", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var body string
			var err error
			if tc.tls {
				body, err = b.viaTLS(tc.sni, tc.host)
			} else {
				body, err = b.viaHTTP(tc.host)
			}
			if tc.want == "" {
				if err == nil {
					t.Fatalf("passed, got %q", body)
				}
				return
			}
			if err != nil || body != tc.want {
				t.Fatalf("got %q, %v; want %q", body, err, tc.want)
			}
		})
	}
	if r := Refused(b.root, "box1", 100); len(r) < 4 || !strings.Contains(strings.Join(r, "\n"), "other.test: not a name the policy allows") {
		t.Errorf("refusals: %q", r)
	}
	// A raw connection with no TLS at all is refused.
	c, err := net.Dial("tcp4", b.p.Addrs().TLS.String())
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprint(c, "hello\r\n\r\n")
	if n, err := c.Read(make([]byte, 10)); err == nil {
		t.Errorf("a raw connection got %d bytes back", n)
	}
	c.Close()

	// A changed policy holds from the next connection.
	b.setPolicy(t, Spec{Mode: DenyAll, Allow: []string{"other.test"}})
	if _, err := b.viaTLS("allowed.test", "allowed.test"); err == nil {
		t.Error("allowed.test passes after the policy dropped it")
	}
	if body, err := b.viaTLS("other.test", "other.test"); err != nil || body != "other" {
		t.Errorf("other.test after the policy allowed it: %q %v", body, err)
	}
	// No policy file: nothing passes.
	if err := RemoveBox(b.root, netip.MustParseAddr("127.0.0.1"), ""); err != nil {
		t.Fatal(err)
	}
	if _, err := b.viaHTTP("other.test"); err == nil {
		t.Error("a connection from an address with no box passed")
	}
}

func TestResolver(t *testing.T) {
	b := startProxy(t)
	ask := func(name, network string) (*dns.Msg, error) {
		q := new(dns.Msg)
		q.SetQuestion(dns.Fqdn(name), dns.TypeA)
		addr := b.p.Addrs().DNSUDP.String()
		if network == "tcp" {
			addr = b.p.Addrs().DNSTCP.String()
		}
		r, _, err := (&dns.Client{Net: network, Timeout: 5 * time.Second}).Exchange(q, addr)
		return r, err
	}
	b.setPolicy(t, Spec{Mode: DenyAll, Allow: []string{"allowed.test", "*.wild.test"}})
	for _, network := range []string{"udp", "tcp"} {
		for name, want := range map[string]string{"allowed.test": "127.0.0.2", "api.wild.test": "127.0.0.2", "other.test": "", "wild.test": ""} {
			r, err := ask(name, network)
			if err != nil {
				t.Fatalf("%s over %s: %v", name, network, err)
			}
			if want == "" {
				if r.Rcode != dns.RcodeNameError || len(r.Answer) != 0 {
					t.Errorf("%s over %s: %s %v, want NXDOMAIN", name, network, dns.RcodeToString[r.Rcode], r.Answer)
				}
				continue
			}
			if len(r.Answer) != 1 || r.Answer[0].(*dns.A).A.String() != want {
				t.Errorf("%s over %s: %v, want %s", name, network, r.Answer, want)
			}
		}
	}
	// A deny-list policy resolves every name.
	b.setPolicy(t, Spec{Deny: []string{"198.51.100.0/24"}})
	if r, err := ask("other.test", "udp"); err != nil || len(r.Answer) != 1 {
		t.Errorf("other.test under a deny-list: %v %v", r, err)
	}
	// No box: refused.
	RemoveBox(b.root, netip.MustParseAddr("127.0.0.1"), "")
	if r, err := ask("allowed.test", "udp"); err != nil || r.Rcode != dns.RcodeRefused {
		t.Errorf("a query from no box: %v %v", r, err)
	}
}

func TestPeek(t *testing.T) {
	// A real ClientHello, as Go's client writes it.
	cr, cw := net.Pipe()
	go func() {
		tls.Client(cw, &tls.Config{ServerName: "api.example.com", InsecureSkipVerify: true}).Handshake()
		cw.Close()
	}()
	cr.SetDeadline(time.Now().Add(5 * time.Second))
	name, hello, err := PeekSNI(cr)
	cr.Close()
	if err != nil || name != "api.example.com" || len(hello) < 50 || hello[0] != 22 {
		t.Fatalf("PeekSNI: %q, %d bytes, %v", name, len(hello), err)
	}
	if _, _, err := PeekSNI(strings.NewReader("GET / HTTP/1.1\r\n\r\n")); err == nil {
		t.Error("PeekSNI took HTTP for TLS")
	}
	req := "POST /x HTTP/1.1\r\nHost: API.Example.com:8080\r\nContent-Length: 4\r\n\r\nbody"
	host, head, err := PeekHost(strings.NewReader(req))
	if err != nil || host != "api.example.com" || string(head) != req {
		t.Fatalf("PeekHost: %q %q %v", host, head, err)
	}
	if _, _, err := PeekHost(strings.NewReader("\x16\x03\x01garbage")); err == nil {
		t.Error("PeekHost took garbage")
	}
}

// A name with a header transform: the proxy terminates TLS with the
// host's CA for that name, sets the header from the secret store on every
// request (over what the box sent), and goes on over TLS to the name.
func TestProxyHeaderTransform(t *testing.T) {
	b := startProxy(t)
	if _, err := EnsureCA(b.root); err != nil {
		t.Fatal(err)
	}
	caPEM, _ := os.ReadFile(CACertFile(b.root))
	hostCA := x509.NewCertPool()
	hostCA.AppendCertsFromPEM(caPEM)
	if fi, err := os.Stat(caKeyFile(b.root)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the CA key: %v %v", fi, err)
	}
	b.setPolicy(t, Spec{Mode: DenyAll, Allow: []string{"example.com", "allowed.test"}, Headers: []string{"example.com:authorization=Bearer ${secret:k1}"}})
	var fetchAs func(sni, host, path string, roots *x509.CertPool, extra string) (string, error)
	fetch := func(sni string, roots *x509.CertPool, extra string) (string, error) {
		return fetchAs(sni, sni, "/", roots, extra)
	}
	fetchAs = func(sni, host, path string, roots *x509.CertPool, extra string) (string, error) {
		c, err := net.DialTimeout("tcp4", b.p.Addrs().TLS.String(), 5*time.Second)
		if err != nil {
			return "", err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		tc := tls.Client(c, &tls.Config{ServerName: sni, RootCAs: roots, InsecureSkipVerify: roots == nil})
		if err := tc.Handshake(); err != nil {
			return "", err
		}
		fmt.Fprintf(tc, "GET %s HTTP/1.1\r\nHost: %s\r\n%sConnection: close\r\n\r\n", path, host, extra)
		resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return fmt.Sprintf("%d %s", resp.StatusCode, body), nil
	}
	// No secret yet: the request fails, and says which header.
	if got, err := fetch("example.com", hostCA, ""); err != nil || !strings.HasPrefix(got, "502 ") {
		t.Errorf("without the secret: %q %v", got, err)
	}
	if err := SetSecret(b.root, "k1", []byte("s3cret\n")); err != nil {
		t.Fatal(err)
	}
	for _, extra := range []string{"", "Authorization: Bearer the-box-own\r\n"} {
		if got, err := fetch("example.com", hostCA, extra); err != nil || got != "200 allowed auth=Bearer s3cret" {
			t.Errorf("with the secret (%q): %q %v", extra, got, err)
		}
	}
	// The secret goes to the name of the TLS session alone: a Host of the
	// box's naming another (or an absolute URL) is sent as that name.
	for _, c := range []struct{ host, path string }{{"other.test", "/host"}, {"example.com", "https://other.test/host"}} {
		if got, err := fetchAs("example.com", c.host, c.path, hostCA, ""); err != nil || got != "200 allowed host=example.com auth=Bearer s3cret" {
			t.Errorf("Host %s, %s: %q %v", c.host, c.path, got, err)
		}
	}
	// Only that name is terminated: another allowed one keeps its own
	// server's certificate.
	if _, err := fetch("allowed.test", hostCA, ""); err == nil {
		t.Error("allowed.test was terminated with the host's CA")
	}
	if got, err := fetch("allowed.test", nil, ""); err != nil || got != "200 allowed" {
		t.Errorf("allowed.test through: %q %v", got, err)
	}
	// The secret is in no policy file.
	data, _ := os.ReadFile(BoxFile(b.root, netip.MustParseAddr("127.0.0.1")))
	if strings.Contains(string(data), "s3cret") {
		t.Error("the secret is in the box's policy file")
	}
	if names, _ := Secrets(b.root); len(names) != 1 || names[0] != "k1" {
		t.Errorf("Secrets: %v", names)
	}
	if err := RemoveSecret(b.root, "k1"); err != nil {
		t.Fatal(err)
	}
}

// What a box sends (an SNI, a Host, a query name) is one printable line
// in its refusal log, never lines of its own.
func TestRefusalOneLine(t *testing.T) {
	root := t.TempDir()
	p := &Proxy{StateDir: root, Log: log.New(io.Discard, "", 0)}
	b := Box{Name: "box1", Addr: netip.MustParseAddr("127.0.0.1")}
	p.refuse(b, "http", "%s: not a name the policy allows", "evil.test\n2026-01-01T00:00:00Z tls forged\x1b[2J")
	lines := Refused(root, "box1", 10)
	if len(lines) != 1 || strings.ContainsAny(lines[0], "\n\x1b") || !strings.Contains(lines[0], `evil.test\n2026`) {
		t.Errorf("refusal log %q", lines)
	}
	if oneLine("plain.test: ok") != "plain.test: ok" {
		t.Error("oneLine changed a plain line")
	}
}
