package egress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/miekg/dns"
)

// Proxy is kvbox's host-side egress proxy and resolver, one per state dir,
// for every box with a policy (kvbox's redirect sends it their traffic):
//   - TLS: it reads the connection's ClientHello (crypto/tls parses it; no
//     byte goes back), and lets it through only when the SNI is a name the
//     box's policy allows, to that name as its own resolver answers it
//     (never to the address the box dialled), replaying the hello: the TLS
//     session is the box's with the server, untouched;
//   - HTTP: the same with the request's Host header;
//   - DNS: it answers a box's queries (UDP and TCP) through its upstream,
//     and where the policy denies every address, only for allowed names.
//
// A connection without a name (no SNI, no Host) is refused, and so is a
// name that resolves only to ranges no box reaches or to the host itself.
type Proxy struct {
	// StateDir is kvbox's state dir, where the boxes' files are (BoxFile).
	StateDir string
	// Listen is the address to listen on ("": every address).
	Listen string
	// Ports to listen on (0: one the kernel picks; Addrs tells which).
	HTTPPort, TLSPort, DNSPort uint16
	// Upstream is the DNS server "ADDR:PORT" the proxy and the resolver ask
	// ("": the host's first nameserver).
	Upstream string
	// UpstreamHTTP, UpstreamTLS are the ports dialled on an allowed name
	// (0: 80 and 443).
	UpstreamHTTP, UpstreamTLS uint16
	// Reachable says whether the proxy may dial a (nil: not in Blocked,
	// IPv4, not one of the host's own addresses).
	Reachable func(a netip.Addr) bool
	// UpstreamCAFile, UpstreamRoots: where a header transform's
	// connection to the name trusts more than the host's roots (a test's
	// CA); UpstreamRoots replaces them.
	UpstreamCAFile string
	UpstreamRoots  *x509.CertPool
	// Log gets one line per refusal and failure (nil: stderr).
	Log *log.Logger

	mu    sync.Mutex
	addrs Addrs
	ic    *interceptState
}

// Addrs are the addresses a Proxy listens on.
type Addrs struct{ HTTP, TLS, DNSUDP, DNSTCP net.Addr }

// Addrs are where p listens, once Serve called ready.
func (p *Proxy) Addrs() Addrs {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.addrs
}

func (p *Proxy) logf(format string, a ...any) {
	if p.Log != nil {
		p.Log.Printf(format, a...)
		return
	}
	log.Printf(format, a...)
}

// Serve listens and serves until ctx ends or a listener fails; ready, if
// not nil, is called once every listener is bound.
func (p *Proxy) Serve(ctx context.Context, ready func()) error {
	if p.Upstream == "" {
		up, err := HostResolver()
		if err != nil {
			return err
		}
		p.Upstream = up
	}
	listen := func(port uint16) (net.Listener, error) {
		return net.Listen("tcp4", net.JoinHostPort(p.Listen, strconv.Itoa(int(port))))
	}
	hl, err := listen(p.HTTPPort)
	if err != nil {
		return fmt.Errorf("egress proxy: %w", err)
	}
	defer hl.Close()
	tl, err := listen(p.TLSPort)
	if err != nil {
		return fmt.Errorf("egress proxy: %w", err)
	}
	defer tl.Close()
	dl, err := listen(p.DNSPort)
	if err != nil {
		return fmt.Errorf("egress resolver: %w", err)
	}
	defer dl.Close()
	du, err := net.ListenPacket("udp4", net.JoinHostPort(p.Listen, strconv.Itoa(int(p.DNSPort))))
	if err != nil {
		return fmt.Errorf("egress resolver: %w", err)
	}
	defer du.Close()
	p.mu.Lock()
	p.addrs = Addrs{HTTP: hl.Addr(), TLS: tl.Addr(), DNSUDP: du.LocalAddr(), DNSTCP: dl.Addr()}
	p.mu.Unlock()

	errs := make(chan error, 4)
	go func() { errs <- p.accept(ctx, hl, p.serveHTTP) }()
	go func() { errs <- p.accept(ctx, tl, p.serveTLS) }()
	h := dns.HandlerFunc(p.serveDNS)
	us := &dns.Server{PacketConn: du, Handler: h}
	ts := &dns.Server{Listener: dl, Handler: h}
	go func() { errs <- us.ActivateAndServe() }()
	go func() { errs <- ts.ActivateAndServe() }()
	if ready != nil {
		ready()
	}
	select {
	case <-ctx.Done():
		us.Shutdown()
		ts.Shutdown()
		return nil
	case err := <-errs:
		return fmt.Errorf("egress proxy: %w", err)
	}
}

func (p *Proxy) accept(ctx context.Context, l net.Listener, serve func(context.Context, net.Conn)) error {
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		go serve(ctx, c)
	}
}

// boxOf is the box whose address c comes from, with its policy compiled.
func (p *Proxy) boxOf(remote net.Addr) (Box, Compiled, error) {
	ap, err := netip.ParseAddrPort(remote.String())
	if err != nil {
		return Box{}, Compiled{}, err
	}
	a := ap.Addr().Unmap()
	b, err := ReadBox(p.StateDir, a)
	if err != nil {
		return Box{}, Compiled{}, fmt.Errorf("no box with a policy at %s: %w", a, err)
	}
	c, err := b.Policy.Compile()
	return b, c, err
}

// peekTimeout bounds reading the ClientHello or the request head.
const peekTimeout = 15 * time.Second

func (p *Proxy) serveTLS(ctx context.Context, c net.Conn) {
	defer c.Close()
	b, pol, err := p.boxOf(c.RemoteAddr())
	if err != nil {
		p.logf("tls from %s: %v", c.RemoteAddr(), err)
		return
	}
	c.SetReadDeadline(time.Now().Add(peekTimeout))
	name, hello, err := PeekSNI(c)
	c.SetReadDeadline(time.Time{})
	if err != nil || name == "" {
		p.refuse(b, "tls", "%s: no TLS server name (SNI): only names the policy allows pass", localTarget(c))
		return
	}
	if pol.AllowsName(name) && len(b.Policy.HeadersFor(name)) > 0 {
		p.intercept(c, b, name, hello)
		return
	}
	p.relay(ctx, c, b, pol, "tls", name, p.upstreamPort(p.UpstreamTLS, 443), hello)
}

func (p *Proxy) serveHTTP(ctx context.Context, c net.Conn) {
	defer c.Close()
	b, pol, err := p.boxOf(c.RemoteAddr())
	if err != nil {
		p.logf("http from %s: %v", c.RemoteAddr(), err)
		return
	}
	c.SetReadDeadline(time.Now().Add(peekTimeout))
	host, head, err := PeekHost(c)
	c.SetReadDeadline(time.Time{})
	if err != nil || host == "" {
		p.refuse(b, "http", "%s: no HTTP Host: only names the policy allows pass", localTarget(c))
		return
	}
	p.relay(ctx, c, b, pol, "http", host, p.upstreamPort(p.UpstreamHTTP, 80), head)
}

func (p *Proxy) upstreamPort(set, def uint16) uint16 {
	if set != 0 {
		return set
	}
	return def
}

// localTarget names what a redirected connection reached, for the log.
func localTarget(c net.Conn) string { return c.LocalAddr().String() }

// relay checks name against the policy, dials it and copies both ways,
// starting with what was read (first).
func (p *Proxy) relay(ctx context.Context, c net.Conn, b Box, pol Compiled, kind, name string, port uint16, first []byte) {
	if _, err := netip.ParseAddr(name); err == nil || !pol.AllowsName(name) {
		p.refuse(b, kind, "%s: not a name the policy allows", name)
		return
	}
	up, err := p.dial(ctx, name, port)
	if err != nil {
		p.refuse(b, kind, "%s: %v", name, err)
		return
	}
	defer up.Close()
	if _, err := up.Write(first); err != nil {
		return
	}
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		io.Copy(dst, src)
		if tc, ok := dst.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
		done <- struct{}{}
	}
	go cp(up, c)
	go cp(c, up)
	<-done
	<-done
}

// dial resolves name through the upstream and dials the first of its
// addresses a box may reach.
func (p *Proxy) dial(ctx context.Context, name string, port uint16) (net.Conn, error) {
	addrs, err := p.lookupA(ctx, name)
	if err != nil {
		return nil, err
	}
	reachable := p.Reachable
	if reachable == nil {
		reachable = DefaultReachable
	}
	var last error = fmt.Errorf("resolves to no address")
	for _, a := range addrs {
		if !reachable(a) {
			last = fmt.Errorf("resolves to %s, which no box reaches", a)
			continue
		}
		d := net.Dialer{Timeout: 10 * time.Second}
		c, err := d.DialContext(ctx, "tcp4", netip.AddrPortFrom(a, port).String())
		if err == nil {
			return c, nil
		}
		last = err
	}
	return nil, last
}

// DefaultReachable: an IPv4 address outside Blocked and not the host's
// own.
func DefaultReachable(a netip.Addr) bool {
	if !a.Is4() || IsBlocked(a) || a.IsUnspecified() {
		return false
	}
	ifas, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, ifa := range ifas {
		if n, ok := ifa.(*net.IPNet); ok {
			if h, ok := netip.AddrFromSlice(n.IP); ok && h.Unmap() == a {
				return false
			}
		}
	}
	return true
}

// lookupA asks the upstream for name's IPv4 addresses.
func (p *Proxy) lookupA(ctx context.Context, name string) ([]netip.Addr, error) {
	q := new(dns.Msg)
	q.SetQuestion(dns.Fqdn(name), dns.TypeA)
	r, err := p.exchange(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("resolve %s: %w", name, err)
	}
	if r.Rcode != dns.RcodeSuccess {
		return nil, fmt.Errorf("resolve %s: %s", name, dns.RcodeToString[r.Rcode])
	}
	var out []netip.Addr
	for _, rr := range r.Answer {
		if a, ok := rr.(*dns.A); ok {
			if ad, ok := netip.AddrFromSlice(a.A.To4()); ok {
				out = append(out, ad)
			}
		}
	}
	return out, nil
}

// exchange asks the upstream, over TCP when the UDP answer is truncated.
func (p *Proxy) exchange(ctx context.Context, q *dns.Msg) (*dns.Msg, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c := &dns.Client{Net: "udp"}
	r, _, err := c.ExchangeContext(ctx, q, p.Upstream)
	if err == nil && r.Truncated {
		c.Net = "tcp"
		r, _, err = c.ExchangeContext(ctx, q, p.Upstream)
	}
	return r, err
}

func (p *Proxy) serveDNS(w dns.ResponseWriter, q *dns.Msg) {
	reply := func(rcode int) {
		m := new(dns.Msg)
		m.SetRcode(q, rcode)
		w.WriteMsg(m)
	}
	b, pol, err := p.boxOf(w.RemoteAddr())
	if err != nil {
		p.logf("dns from %s: %v", w.RemoteAddr(), err)
		reply(dns.RcodeRefused)
		return
	}
	if len(q.Question) != 1 {
		reply(dns.RcodeFormatError)
		return
	}
	name := q.Question[0].Name
	if !pol.AllowsQuery(name) {
		p.refuse(b, "dns", "%s: not a name the policy allows", strings.TrimSuffix(name, "."))
		reply(dns.RcodeNameError)
		return
	}
	r, err := p.exchange(context.Background(), q)
	if err != nil {
		p.logf("dns for %s (%s): %v", b.Name, name, err)
		reply(dns.RcodeServerFailure)
		return
	}
	r.Id = q.Id
	w.WriteMsg(r)
}

// PeekSNI reads a TLS ClientHello from c and returns its server name and
// every byte read; nothing is written to c.
func PeekSNI(c io.Reader) (string, []byte, error) {
	var buf bytes.Buffer
	rc := readOnly{r: io.TeeReader(c, &buf)}
	var name string
	seen := false
	errPeeked := errors.New("peeked")
	err := tls.Server(rc, &tls.Config{GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		name, seen = h.ServerName, true
		return nil, errPeeked
	}}).Handshake()
	if !seen {
		return "", buf.Bytes(), fmt.Errorf("no TLS ClientHello: %v", err)
	}
	return name, buf.Bytes(), nil
}

// PeekHost reads an HTTP request head from c and returns its Host (less
// any port) and every byte read.
func PeekHost(c io.Reader) (string, []byte, error) {
	var buf bytes.Buffer
	req, err := http.ReadRequest(bufio.NewReader(io.TeeReader(c, &buf)))
	if err != nil {
		return "", buf.Bytes(), err
	}
	host := req.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	return strings.TrimSuffix(strings.ToLower(host), "."), buf.Bytes(), nil
}

// readOnly is a net.Conn that reads from r and refuses to write.
type readOnly struct{ r io.Reader }

func (c readOnly) Read(b []byte) (int, error)     { return c.r.Read(b) }
func (readOnly) Write([]byte) (int, error)        { return 0, io.ErrClosedPipe }
func (readOnly) Close() error                     { return nil }
func (readOnly) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (readOnly) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (readOnly) SetDeadline(time.Time) error      { return nil }
func (readOnly) SetReadDeadline(time.Time) error  { return nil }
func (readOnly) SetWriteDeadline(time.Time) error { return nil }

// HostResolver is the host's first nameserver as ADDR:53.
func HostResolver() (string, error) {
	for _, f := range []string{"/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"} {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n") {
			fl := strings.Fields(line)
			if len(fl) >= 2 && fl[0] == "nameserver" {
				if a, err := netip.ParseAddr(fl[1]); err == nil {
					return netip.AddrPortFrom(a, 53).String(), nil
				}
			}
		}
	}
	return "", fmt.Errorf("egress resolver: the host has no nameserver (/etc/resolv.conf): give one (KVBOX_EGRESS_UPSTREAM)")
}

// Refusals: what the proxy and the resolver refused a box lately, kept in
// STATE/egress/refused/NAME.log (kvbox egress show).

const refusedMax = 64 << 10

// RefusedLog is box name's refusal log.
func RefusedLog(root, name string) string { return filepath.Join(Dir(root), "refused", name+".log") }

func (p *Proxy) refuse(b Box, kind, format string, a ...any) {
	// What the box sent (a name, a Host) is one printable line here: a box
	// writes no line of its own into its log or the proxy's.
	line := fmt.Sprintf("%s %s %s", time.Now().UTC().Format(time.RFC3339), kind, oneLine(fmt.Sprintf(format, a...)))
	p.logf("refused %s (%s): %s", b.Name, b.Addr, line)
	path := RefusedLog(p.StateDir, b.Name)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return
	}
	if fi, err := os.Stat(path); err == nil && fi.Size() > refusedMax {
		os.Rename(path, path+".old")
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintln(f, line)
}

// oneLine is s with every control character (and invalid UTF-8) quoted
// in Go's way, so that it prints as one line.
func oneLine(s string) string {
	if !strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f || r == utf8.RuneError || (r >= 0x80 && r < 0xa0) }) {
		return s
	}
	q := strconv.Quote(s)
	return q[1 : len(q)-1]
}

// Refused are the last n lines of box name's refusal log.
func Refused(root, name string, n int) []string {
	data, _ := os.ReadFile(RefusedLog(root, name))
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	if len(lines) == 1 && lines[0] == "" {
		return nil
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return lines
}

// ForgetRefused removes box name's refusal logs (the box is removed).
func ForgetRefused(root, name string) {
	os.Remove(RefusedLog(root, name))
	os.Remove(RefusedLog(root, name) + ".old")
}
