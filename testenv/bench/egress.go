package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/testenv/benchstat"
)

// The egress section's fake internet: a namespace of its own beyond the
// bench's bridge (reached through kvbox's NAT over a veth pair on
// 198.18.81.0/30), with an HTTP and HTTPS server and a DNS server on
// benchmarking addresses no test uses.
const (
	egBenchServer = "198.18.82.10" // bench.test
	egBenchDNS    = "198.18.82.53"
	egBenchName   = "bench.test"
	egBenchBig    = 64 << 20 // the large download
	egBenchBox    = "bench-egress"
)

// egressModes are the ways a request leaves the box, timed alternately.
var egressModes = []struct{ name, desc string }{
	{"direct", "no policy (allow-all): NAT only"},
	{"proxy", "deny-all --allow bench.test: kvbox's proxy peeks the SNI/Host and relays"},
	{"transform", "the same with a header from a secret: the proxy terminates TLS, sets it, and goes on over TLS"},
}

// benchEgress times, in one run, requests from a box to a server of the
// section's own namespace through kvbox's egress proxy against the same
// requests with no policy: a small HTTPS request (each a new curl: connect,
// TLS, request), p50 and p90, and a large download's throughput over HTTP
// and HTTPS. The modes alternate round by round, so the machine's load
// weighs on all alike.
func benchEgress(ctx context.Context, e *env) error {
	if _, err := os.Stat("bin/kvbox"); err != nil {
		return fmt.Errorf("bin/kvbox: %w (make bench builds it)", err)
	}
	if bs, _ := egress.Boxes(e.stateDir); len(bs) > 0 {
		return fmt.Errorf("box %s of this state dir has an egress policy: the section points the state dir's egress proxy at a resolver of its own, so it wants a state dir where no box has one", bs[0].Name)
	}
	caPEM, stop, err := egressInternet()
	if err != nil {
		return err
	}
	defer stop()
	dir, err := os.MkdirTemp("", "kvbox-bench-egress-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	caFile := filepath.Join(dir, "bench-ca.pem")
	if err := os.WriteFile(caFile, caPEM, 0o644); err != nil {
		return err
	}
	// The state dir's proxy, started by the commands below, asks the
	// section's resolver and trusts its CA; one already running (its
	// resolver another) is ended first, and the one started here when the
	// section ends (any kvbox command starts another when a box needs it).
	os.Setenv("KVBOX_EGRESS_UPSTREAM", egBenchDNS+":53")
	os.Setenv("KVBOX_EGRESS_UPSTREAM_CA", caFile)
	defer os.Unsetenv("KVBOX_EGRESS_UPSTREAM")
	defer os.Unsetenv("KVBOX_EGRESS_UPSTREAM_CA")
	stopEgressProxy(e.stateDir)
	defer stopEgressProxy(e.stateDir)
	// The box reaches the fake internet through the NAT, which a bench
	// namespace without a default route has only when asked for.
	var before struct{ NAT bool }
	if out, err := e.kvboxOut(ctx, "network", "show", "--json"); err == nil {
		json.Unmarshal([]byte(out), &before)
	}
	if _, err := e.kvboxCLI(ctx, "network", "up", "--nat"); err != nil {
		return err
	}
	if !before.NAT {
		defer e.kvboxCLI(context.Background(), "network", "rm")
	}
	if _, err := e.kvboxCLI(ctx, "new", "--image", "debian", "--cpus", "1", "--memory", "1G", egBenchBox); err != nil {
		return fmt.Errorf("%w (make testenv builds the Debian image)", err)
	}
	defer e.kvboxCLI(context.Background(), "rm", "--force", egBenchBox)
	if _, err := e.kvboxCLI(ctx, "cp", caFile, egBenchBox+":/root/"); err != nil {
		return err
	}
	secret := filepath.Join(dir, "secret")
	os.WriteFile(secret, []byte("bench-"+strconv.FormatInt(time.Now().UnixNano(), 36)+"\n"), 0o600)
	if err := e.kvboxCLIIn(ctx, secret, "secrets", "set", "bench-egress"); err != nil {
		return err
	}
	defer e.kvboxCLI(context.Background(), "secrets", "rm", "bench-egress")

	policy := map[string][]string{
		"direct":    {"--egress", "allow-all"},
		"proxy":     {"--egress", "deny-all", "--allow", egBenchName},
		"transform": {"--egress", "deny-all", "--allow", egBenchName, "--header", egBenchName + ":Authorization=Bearer ${secret:bench-egress}"},
	}
	const rounds, perRound = 5, 20
	small := map[string][]time.Duration{}
	dl := map[string][]float64{} // MB/s, "MODE http" and "MODE https"
	for round := 0; round < rounds; round++ {
		for _, m := range egressModes {
			if _, err := e.kvboxCLI(ctx, append([]string{"egress", "set", egBenchBox}, policy[m.name]...)...); err != nil {
				return err
			}
			ts, err := egressSmall(ctx, e, m.name, perRound)
			if err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
			small[m.name] = append(small[m.name], ts...)
			if round < 3 {
				for _, scheme := range []string{"http", "https"} {
					if m.name == "transform" && scheme == "http" {
						continue // a header is set on HTTPS only
					}
					v, err := egressDownload(ctx, e, m.name, scheme)
					if err != nil {
						return fmt.Errorf("%s %s download: %w", m.name, scheme, err)
					}
					dl[m.name+" "+scheme] = append(dl[m.name+" "+scheme], v)
				}
			}
		}
	}
	fmt.Printf("a small HTTPS request from the box (a new curl each: connect, TLS, GET; %d per mode in %d alternated rounds), and a %d MiB download (median of 3):\n", rounds*perRound, rounds, egBenchBig>>20)
	fmt.Printf("%-10s %9s %9s %12s %12s   %s\n", "mode", "p50 ms", "p90 ms", "HTTP MB/s", "HTTPS MB/s", "")
	for _, m := range egressModes {
		h := "-"
		if v := dl[m.name+" http"]; len(v) > 0 {
			h = fmt.Sprintf("%.1f", median(v))
		}
		fmt.Printf("%-10s %9.1f %9.1f %12s %12.1f   %s\n", m.name, benchstat.Ms(benchstat.Pct(small[m.name], 50)), benchstat.Ms(benchstat.Pct(small[m.name], 90)),
			h, median(dl[m.name+" https"]), m.desc)
	}
	d50, d90 := benchstat.Pct(small["direct"], 50), benchstat.Pct(small["direct"], 90)
	for _, m := range egressModes[1:] {
		p50, p90 := benchstat.Pct(small[m.name], 50), benchstat.Pct(small[m.name], 90)
		fmt.Printf("%s against direct: %+.1f ms at p50 (%.2fx), %+.1f ms at p90 (%.2fx)", m.name,
			benchstat.Ms(p50-d50), float64(p50)/float64(d50), benchstat.Ms(p90-d90), float64(p90)/float64(d90))
		if v := dl[m.name+" http"]; len(v) > 0 {
			fmt.Printf("; HTTP download %.2fx", median(v)/median(dl["direct http"]))
		}
		fmt.Printf("; HTTPS download %.2fx\n", median(dl[m.name+" https"])/median(dl["direct https"]))
	}
	return nil
}

// curlArgs are the box's curl flags for mode: the name pinned to the
// server's address (no DNS in what is timed), and one CA file to trust:
// the section's, or where the proxy serves the name the host's egress CA
// as kvbox put it in the guest (curl's whole default bundle would cost the
// guest a parse of every CA in it per request, which is no part of the
// proxy's cost).
func curlArgs(mode, scheme string) string {
	port := map[string]string{"http": "80", "https": "443"}[scheme]
	a := fmt.Sprintf("--resolve %s:%s:%s --cacert ", egBenchName, port, egBenchServer)
	if mode == "transform" {
		return a + "/usr/local/share/ca-certificates/kvbox-egress.crt"
	}
	return a + "/root/bench-ca.pem"
}

// egressSmall times n small HTTPS requests from the box, each a new curl.
func egressSmall(ctx context.Context, e *env, mode string, n int) ([]time.Duration, error) {
	script := fmt.Sprintf(`for i in $(seq %d); do curl -sS -o /dev/null -w '%%{http_code} %%{time_total}\n' %s https://%s/small || echo fail; done`,
		n, curlArgs(mode, "https"), egBenchName)
	out, err := e.kvboxOut(ctx, "exec", egBenchBox, "--", "sh", "-c", script)
	if err != nil {
		return nil, err
	}
	var ts []time.Duration
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) != 2 || f[0] != "200" {
			return nil, fmt.Errorf("curl: %q", l)
		}
		s, err := strconv.ParseFloat(f[1], 64)
		if err != nil {
			return nil, fmt.Errorf("curl: %q", l)
		}
		ts = append(ts, time.Duration(s*float64(time.Second)))
	}
	if len(ts) != n {
		return nil, fmt.Errorf("%d timings of %d", len(ts), n)
	}
	return ts, nil
}

// egressDownload is the large download's throughput in MB/s.
func egressDownload(ctx context.Context, e *env, mode, scheme string) (float64, error) {
	script := fmt.Sprintf(`curl -sS -o /dev/null -w '%%{http_code} %%{size_download} %%{speed_download}\n' %s %s://%s/big`,
		curlArgs(mode, scheme), scheme, egBenchName)
	out, err := e.kvboxOut(ctx, "exec", egBenchBox, "--", "sh", "-c", script)
	if err != nil {
		return 0, err
	}
	f := strings.Fields(out)
	if len(f) != 3 || f[0] != "200" || f[1] != strconv.Itoa(egBenchBig) {
		return 0, fmt.Errorf("curl: %q", out)
	}
	bps, err := strconv.ParseFloat(f[2], 64)
	return bps / 1e6, err
}

// kvboxOut runs bin/kvbox and returns its standard output.
func (e *env) kvboxOut(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "bin/kvbox", append([]string{"--state-dir", e.stateDir}, args...)...)
	var errb strings.Builder
	cmd.Stderr = &errb
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("kvbox %s: %v: %s", strings.Join(args, " "), err, errb.String())
	}
	return string(out), nil
}

// kvboxCLIIn runs bin/kvbox with the file stdin as its standard input.
func (e *env) kvboxCLIIn(ctx context.Context, stdin string, args ...string) error {
	f, err := os.Open(stdin)
	if err != nil {
		return err
	}
	defer f.Close()
	cmd := exec.CommandContext(ctx, "bin/kvbox", append([]string{"--state-dir", e.stateDir}, args...)...)
	cmd.Stdin = f
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("kvbox %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

// stopEgressProxy ends the state dir's egress proxy, if one runs (its
// worker dies with it), and waits until it is gone.
func stopEgressProxy(stateDir string) {
	b, err := os.ReadFile(filepath.Join(egress.Dir(stateDir), "proxy.lock"))
	if err != nil {
		return
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if pid <= 1 || !strings.Contains(string(cmd), "__egress-proxy") {
		return
	}
	unix.Kill(pid, unix.SIGKILL)
	for range 100 {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// egressInternet makes the fake internet and returns its CA's
// certificate and what removes it all.
func egressInternet() ([]byte, func(), error) {
	ns := fmt.Sprintf("kvbox-bench-eg-%d", os.Getpid())
	up, peer := "kvbbeg0", "kvbbeg1"
	var undo []func()
	stop := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	run := func(args ...string) error {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	fail := func(err error) ([]byte, func(), error) { stop(); return nil, nil, err }
	if err := run("ip", "netns", "add", ns); err != nil {
		return fail(err)
	}
	undo = append(undo, func() { run("ip", "netns", "del", ns) })
	if err := run("ip", "link", "add", up, "type", "veth", "peer", "name", peer, "netns", ns); err != nil {
		return fail(err)
	}
	undo = append(undo, func() { run("ip", "link", "del", up) })
	in := func(args ...string) error { return run(append([]string{"ip", "netns", "exec", ns}, args...)...) }
	for _, c := range [][]string{
		{"ip", "addr", "add", "198.18.81.1/30", "dev", up}, {"ip", "link", "set", up, "up"},
	} {
		if err := run(c...); err != nil {
			return fail(err)
		}
	}
	for _, c := range [][]string{
		{"ip", "link", "set", "lo", "up"}, {"ip", "addr", "add", "198.18.81.2/30", "dev", peer}, {"ip", "link", "set", peer, "up"},
		{"ip", "addr", "add", egBenchServer + "/32", "dev", "lo"}, {"ip", "addr", "add", egBenchDNS + "/32", "dev", "lo"},
	} {
		if err := in(c...); err != nil {
			return fail(err)
		}
	}
	for _, a := range []string{egBenchServer, egBenchDNS} {
		if err := run("ip", "route", "replace", a+"/32", "via", "198.18.81.2", "dev", up); err != nil {
			return fail(err)
		}
		undo = append(undo, func() { run("ip", "route", "del", a+"/32") })
	}
	caPEM, cert, err := benchCA()
	if err != nil {
		return fail(err)
	}
	chunk := make([]byte, 1<<20)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/big":
			w.Header().Set("Content-Length", strconv.Itoa(egBenchBig))
			for n := 0; n < egBenchBig; n += len(chunk) {
				if _, err := w.Write(chunk); err != nil {
					return
				}
			}
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	err = inNetns(ns, func() error {
		for _, port := range []int{80, 443} {
			l, err := net.Listen("tcp4", net.JoinHostPort(egBenchServer, strconv.Itoa(port)))
			if err != nil {
				return err
			}
			if port == 443 {
				l = tls.NewListener(l, &tls.Config{Certificates: []tls.Certificate{cert}})
			}
			s := &http.Server{Handler: h}
			go s.Serve(l)
			undo = append(undo, func() { s.Close() })
		}
		dh := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
			m := new(dns.Msg)
			m.SetReply(q)
			if strings.TrimSuffix(strings.ToLower(q.Question[0].Name), ".") != egBenchName {
				m.Rcode = dns.RcodeNameError
			} else if q.Question[0].Qtype == dns.TypeA {
				rr, _ := dns.NewRR(q.Question[0].Name + " 30 IN A " + egBenchServer)
				m.Answer = append(m.Answer, rr)
			}
			w.WriteMsg(m)
		})
		pc, err := net.ListenPacket("udp4", egBenchDNS+":53")
		if err != nil {
			return err
		}
		tl, err := net.Listen("tcp4", egBenchDNS+":53")
		if err != nil {
			pc.Close()
			return err
		}
		us, ts := &dns.Server{PacketConn: pc, Handler: dh}, &dns.Server{Listener: tl, Handler: dh}
		go us.ActivateAndServe()
		go ts.ActivateAndServe()
		undo = append(undo, func() { us.Shutdown(); ts.Shutdown() })
		return nil
	})
	if err != nil {
		return fail(err)
	}
	return caPEM, stop, nil
}

// inNetns runs f with this thread in network namespace ns: the sockets f
// opens stay there.
func inNetns(ns string, f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return err
	}
	defer self.Close()
	target, err := os.Open("/run/netns/" + ns)
	if err != nil {
		return err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		return err
	}
	defer func() {
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			panic(err) // this thread must not go back to the pool elsewhere
		}
	}()
	return f()
}

// benchCA makes a CA and a certificate of it for bench.test.
func benchCA() ([]byte, tls.Certificate, error) {
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvbox bench egress CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: egBenchName}, DNSNames: []string{egBenchName},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &key.PublicKey, caKey)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}
