//go:build e2e

package testenv

import (
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
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
)

// The egress tests' fake internet: a namespace of their own beyond
// kvbox's bridge (reached through its NAT over a veth pair on 198.18.80.0/30,
// a benchmarking range no other test uses), with a DNS server, a second
// "rogue" resolver, and HTTP and HTTPS servers on documentation addresses,
// their certificate from a CA the test makes.
const (
	egAllowed = "198.51.100.10" // allowed.test
	egOther   = "198.51.100.11" // other.test (and wild.test)
	egWild    = "198.51.100.12" // api.wild.test
	egDenyA   = "198.51.100.20" // deny-a.test
	egDenyB   = "198.51.100.21"
	egDNS     = "198.51.100.53"
	egRogue   = "198.51.100.54" // answers every name with egNowhere
	egNowhere = "198.51.100.99"
	// egSecret is the secret a header transform sets: the fake server
	// says whether it got it, and it must be nowhere in the box.
	egSecret = "sk-egress-test-Zq8vN2xK"
)

var egNames = map[string]string{"allowed.test": egAllowed, "other.test": egOther, "wild.test": egOther,
	"api.wild.test": egWild, "deny-a.test": egDenyA}

// inNetns runs f with this thread in network namespace ns: sockets f
// opens stay there.
func inNetns(t *testing.T, ns string, f func()) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	target, err := os.Open("/run/netns/" + ns)
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			panic(err) // this thread must not go back to the pool elsewhere
		}
	}()
	f()
}

// testCA makes a CA and a certificate of it for every name of egNames.
func testCA(t *testing.T) (caPEM []byte, cert tls.Certificate) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvbox egress test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "allowed.test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature}
	for n, a := range egNames {
		leaf.DNSNames = append(leaf.DNSNames, n)
		leaf.IPAddresses = append(leaf.IPAddresses, net.ParseIP(a))
	}
	der, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// setupEgressNet makes the fake internet, kvbox's network with NAT, and
// points kvbox's egress resolver at the fake DNS server; it returns the
// test CA's certificate.
func setupEgressNet(t *testing.T) []byte {
	t.Helper()
	id := strings.TrimPrefix(runID, "e2e")
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	ns := "kvbox-eginet-" + runID
	run("ip", "netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	in := func(args ...string) { t.Helper(); run(append([]string{"ip", "netns", "exec", ns}, args...)...) }
	up, peer := "kve"+id, "kvf"+id
	run("ip", "link", "add", up, "type", "veth", "peer", "name", peer, "netns", ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", up).Run() })
	run("ip", "addr", "add", "198.18.80.1/30", "dev", up)
	run("ip", "link", "set", up, "up")
	in("ip", "link", "set", "lo", "up")
	in("ip", "addr", "add", "198.18.80.2/30", "dev", peer)
	in("ip", "link", "set", peer, "up")
	for _, a := range []string{egAllowed, egOther, egWild, egDenyA, egDenyB, egDNS, egRogue} {
		in("ip", "addr", "add", a+"/32", "dev", "lo")
		run("ip", "route", "replace", a+"/32", "via", "198.18.80.2", "dev", up)
		t.Cleanup(func() { exec.Command("ip", "route", "del", a+"/32").Run() })
	}

	caPEM, cert := testCA(t)
	var closers []func()
	t.Cleanup(func() {
		for _, c := range closers {
			c()
		}
	})
	serve := func(l net.Listener, name string, tlsOn bool) {
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "%s host=%s", name, r.Host)
			if r.URL.Path == "/auth" {
				switch a := r.Header.Get("Authorization"); a {
				case "Bearer " + egSecret:
					fmt.Fprint(w, " auth=ok")
				case "":
					fmt.Fprint(w, " auth=none")
				default:
					fmt.Fprint(w, " auth=other")
				}
			}
			fmt.Fprintln(w)
		})
		s := &http.Server{Handler: h}
		if tlsOn {
			l = tls.NewListener(l, &tls.Config{Certificates: []tls.Certificate{cert}})
		}
		go s.Serve(l)
		closers = append(closers, func() { s.Close() })
	}
	dnsServer := func(pc net.PacketConn, tl net.Listener, answer func(name string) (string, bool)) {
		h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
			m := new(dns.Msg)
			m.SetReply(q)
			name := strings.TrimSuffix(strings.ToLower(q.Question[0].Name), ".")
			a, ok := answer(name)
			switch {
			case !ok:
				m.Rcode = dns.RcodeNameError
			case q.Question[0].Qtype == dns.TypeA:
				rr, _ := dns.NewRR(q.Question[0].Name + " 30 IN A " + a)
				m.Answer = append(m.Answer, rr)
			}
			w.WriteMsg(m)
		})
		us, ts := &dns.Server{PacketConn: pc, Handler: h}, &dns.Server{Listener: tl, Handler: h}
		go us.ActivateAndServe()
		go ts.ActivateAndServe()
		closers = append(closers, func() { us.Shutdown(); ts.Shutdown() })
	}
	inNetns(t, ns, func() {
		listen := func(addr string, port int) net.Listener {
			l, err := net.Listen("tcp4", net.JoinHostPort(addr, strconv.Itoa(port)))
			if err != nil {
				t.Fatal(err)
			}
			return l
		}
		for addr, name := range map[string]string{egAllowed: "allowed", egOther: "other", egWild: "wild", egDenyA: "deny-a", egDenyB: "deny-b"} {
			serve(listen(addr, 80), name, false)
			serve(listen(addr, 443), name, true)
			serve(listen(addr, 8080), name, false)
		}
		for addr, answer := range map[string]func(string) (string, bool){
			egDNS:   func(n string) (string, bool) { a, ok := egNames[n]; return a, ok },
			egRogue: func(string) (string, bool) { return egNowhere, true },
		} {
			pc, err := net.ListenPacket("udp4", addr+":53")
			if err != nil {
				t.Fatal(err)
			}
			dnsServer(pc, listen(addr, 53), answer)
		}
	})
	// The bench works from this namespace: what a box cannot reach, kvbox
	// keeps from it.
	eventually(t, 10*time.Second, func() error {
		_, err := httpGet("http://" + egAllowed + "/")
		return err
	})

	t.Setenv("KVBOX_EGRESS_UPSTREAM", egDNS+":53")
	// The proxy's own connections for header transforms trust the test
	// CA (the fake internet's servers have its certificates).
	caFile := filepath.Join(t.TempDir(), "upstream-ca.pem")
	if err := os.WriteFile(caFile, caPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KVBOX_EGRESS_UPSTREAM_CA", caFile)
	// A proxy left by an earlier run has another upstream: this run's
	// kvbox starts its own.
	killEgressProxy(t)
	t.Cleanup(func() { killEgressProxy(t) })
	// NAT without a default route stays until the network goes: the
	// network goes again when the test ends (its boxes gone first, as
	// cleanups run last-in first-out), so the tests after it find the
	// namespace as it was (TestNetworkNATWithUplink: no uplink, no NAT).
	var before struct{ NAT bool }
	json.Unmarshal([]byte(mustKvbox(t, "network", "show", "--json")), &before)
	if !before.NAT {
		t.Cleanup(func() {
			r := kvbox(t, "network", "rm")
			switch {
			case r.code != 0 && strings.Contains(r.stderr, "remove them first"):
				// Boxes that are not the tests' (a demo's, say) are on it:
				// it stays, with the NAT this test asked for.
				t.Logf("network rm after the egress test refused, boxes not the tests' on it: %s", strings.TrimSpace(r.stderr))
			case r.code != 0:
				t.Errorf("network rm after the egress test (its NAT stays otherwise): %s", r)
			}
		})
	}
	mustKvbox(t, "network", "up", "--nat")
	return caPEM
}

// egressProxyPid is the pid of this state dir's egress proxy (0: none).
func egressProxyPid(t *testing.T) int {
	b, err := os.ReadFile(filepath.Join(stateDir, "egress", "proxy.lock"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if pid <= 1 {
		return 0
	}
	cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if !strings.Contains(string(cmd), "__egress-proxy") || !strings.Contains(string(cmd), stateDir) {
		return 0
	}
	return pid
}

// egressWorkerPid is the pid of this state dir's egress proxy's worker
// (0: none).
func egressWorkerPid(t *testing.T) int {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		cmd, _ := os.ReadFile(p)
		args := strings.Split(string(cmd), "\x00")
		if slices.Contains(args, "__egress-proxy") && slices.Contains(args, "--worker") && slices.Contains(args, stateDir) {
			pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
			return pid
		}
	}
	return 0
}

func killEgressProxy(t *testing.T) {
	if pid := egressProxyPid(t); pid > 0 {
		syscall.Kill(pid, syscall.SIGKILL)
		eventually(t, 10*time.Second, func() error {
			if egressProxyPid(t) == pid {
				return fmt.Errorf("egress proxy %d still runs", pid)
			}
			return nil
		})
	}
	// Its worker dies with it.
	eventually(t, 10*time.Second, func() error {
		if w := egressWorkerPid(t); w != 0 {
			return fmt.Errorf("egress proxy worker %d still runs", w)
		}
		return nil
	})
}

// The guest's helpers: a DNS query over UDP or TCP to a given server, and
// an HTTPS/HTTP fetch with Python's urllib.
const dnsqPy = `import socket, struct, sys
server, name, proto = sys.argv[1], sys.argv[2], sys.argv[3]
q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
for l in name.split("."):
    q += bytes([len(l)]) + l.encode()
q += b"\0" + struct.pack(">HH", 1, 1)
try:
    if proto == "tcp":
        s = socket.create_connection((server, 53), timeout=5)
        s.sendall(struct.pack(">H", len(q)) + q)
        n = struct.unpack(">H", s.recv(2))[0]
        r = b""
        while len(r) < n:
            r += s.recv(n - len(r))
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(5)
        s.sendto(q, (server, 53))
        r = s.recv(4096)
except Exception as e:
    print("error", type(e).__name__)
    sys.exit(0)
rcode, an = r[3] & 15, struct.unpack(">H", r[6:8])[0]
i = 12
while r[i] != 0:
    i += r[i] + 1
i += 5
addrs = []
for _ in range(an):
    if r[i] & 0xc0 == 0xc0:
        i += 2
    else:
        while r[i] != 0:
            i += r[i] + 1
        i += 1
    typ, _, _, ln = struct.unpack(">HHIH", r[i:i+10])
    i += 10
    if typ == 1:
        addrs.append(".".join(str(b) for b in r[i:i+4]))
    i += ln
print("rcode=%d a=%s" % (rcode, ",".join(addrs)))
`

const fetchPy = `import ssl, sys, urllib.request
try:
    ctx = ssl.create_default_context(cafile=None if len(sys.argv) > 2 else "/root/egress-ca.pem")
    print(urllib.request.urlopen(sys.argv[1], timeout=30, context=ctx).read().decode().strip())
except Exception as e:
    print("FAIL", type(e).__name__)
`

// egBox is a guest under test.
type egBox struct {
	t    *testing.T
	name string
}

func (b egBox) sh(script string) string {
	b.t.Helper()
	return strings.TrimSpace(inBox(b.t, b.name, script))
}

// curl fetches with curl in the guest: the body, or "FAIL".
func (b egBox) curl(args string) string {
	b.t.Helper()
	return b.sh("curl -s -m 30 --cacert /root/egress-ca.pem " + args + " || echo FAIL")
}

func (b egBox) py(url string) string { b.t.Helper(); return b.sh("python3 /root/fetch.py " + url) }

func (b egBox) dns(server, name, proto string) string {
	b.t.Helper()
	return b.sh(fmt.Sprintf("python3 /root/dnsq.py %s %s %s", server, name, proto))
}

// reaches says whether body is the answer of server name.
func reaches(body, name string) bool { return strings.HasPrefix(body, name+" host=") }

// prepare gives the guest the test CA and the helpers, and the fake DNS
// server as its resolver.
func (b egBox) prepare(caPEM []byte) {
	b.t.Helper()
	dir := b.t.TempDir()
	for f, data := range map[string][]byte{"egress-ca.pem": caPEM, "dnsq.py": []byte(dnsqPy), "fetch.py": []byte(fetchPy)} {
		os.WriteFile(filepath.Join(dir, f), data, 0o644)
		mustKvbox(b.t, "cp", filepath.Join(dir, f), b.name+":/root/")
	}
	b.sh("echo nameserver " + egDNS + " > /etc/resolv.conf")
}

type egStatus struct {
	Policy struct {
		Allow []string `json:"allow"`
		Deny  []string `json:"deny"`
	} `json:"policy"`
	InForce      bool     `json:"in_force"`
	Dropped      uint64   `json:"dropped_packets"`
	Refused      []string `json:"refused"`
	ProxyRunning bool     `json:"proxy_running"`
}

func egressShow(t *testing.T, n string) egStatus {
	t.Helper()
	var st egStatus
	if err := json.Unmarshal([]byte(mustKvbox(t, "egress", "show", "--json", n)), &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// The domain policy of the issue, on the fake internet.
var egDomainPolicy = []string{"--egress", "deny-all", "--allow", "allowed.test", "--allow", "*.wild.test", "--allow", egDenyA}

// checkDomainPolicy checks that box b is under egDomainPolicy: exactly the
// allowed names and address pass, and nothing gets around the proxy.
func checkDomainPolicy(t *testing.T, b egBox, full bool) {
	t.Helper()
	for _, u := range []string{"https://allowed.test/", "http://allowed.test/"} {
		if got := b.curl(u); !reaches(got, "allowed") {
			t.Errorf("curl %s: %q", u, got)
		}
	}
	if got := b.curl("https://api.wild.test/"); !reaches(got, "wild") {
		t.Errorf("curl https://api.wild.test/ (*.wild.test): %q", got)
	}
	if got := b.curl("http://" + egDenyA + "/"); !reaches(got, "deny-a") {
		t.Errorf("curl an allowed address: %q", got)
	}
	for _, u := range []string{"https://other.test/", "https://wild.test/", "http://" + egDenyB + "/",
		"--resolve other.test:443:" + egOther + " https://other.test/", "--resolve other.test:80:" + egOther + " http://other.test/"} {
		if got := b.curl(u); got != "FAIL" {
			t.Errorf("curl %s passed: %q", u, got)
		}
	}
	if !full {
		return
	}
	for _, u := range []string{"https://allowed.test/", "http://allowed.test/"} {
		if got := b.py(u); !reaches(got, "allowed") {
			t.Errorf("urllib %s: %q", u, got)
		}
	}
	if got := b.py("https://other.test/"); !strings.HasPrefix(got, "FAIL") {
		t.Errorf("urllib https://other.test/ passed: %q", got)
	}
	// Around the proxy: the allowed name's address without the name (TLS
	// without SNI, HTTP with an address for Host, another port).
	for _, u := range []string{"-k https://" + egAllowed + "/", "http://" + egAllowed + "/", "http://" + egAllowed + ":8080/"} {
		if got := b.curl(u); got != "FAIL" {
			t.Errorf("curl %s (the allowed name's address, no name) passed: %q", u, got)
		}
	}
	// A raw connection to the allowed name's port 443.
	if got := b.sh(`python3 -c "
import socket
s = socket.create_connection(('` + egAllowed + `', 443), timeout=5)
s.sendall(b'hello\r\n\r\n')
s.settimeout(5)
try:
    print('GOT', s.recv(100))
except Exception as e:
    print('NOTHING', type(e).__name__)
" 2>&1 || echo NOTHING`); strings.HasPrefix(got, "GOT b'") && got != "GOT b''" {
		t.Errorf("a raw TCP connection to %s:443 got an answer: %q", egAllowed, got)
	}
	// A forged SNI toward another address reaches the allowed host, never
	// that address; so does an allowed SNI with another Host.
	if got := b.curl("--resolve allowed.test:443:" + egOther + " https://allowed.test/"); !reaches(got, "allowed") {
		t.Errorf("allowed.test's SNI toward other.test's address: %q, want allowed.test's server", got)
	}
	if got := b.curl("-H 'Host: other.test' https://allowed.test/"); !strings.HasPrefix(got, "allowed host=other.test") {
		t.Errorf("allowed SNI, Host other.test: %q, want allowed.test's server", got)
	}
	if got := b.curl("-H 'Host: allowed.test' http://" + egOther + "/"); !reaches(got, "allowed") {
		t.Errorf("Host allowed.test toward other.test's address: %q, want allowed.test's server", got)
	}
	// DNS: whatever server the box asks, over UDP or TCP, kvbox's resolver
	// answers, and only allowed names.
	for _, server := range []string{egDNS, egRogue, "192.0.2.53"} {
		for _, proto := range []string{"udp", "tcp"} {
			if got := b.dns(server, "allowed.test", proto); got != "rcode=0 a="+egAllowed {
				t.Errorf("allowed.test from %s over %s: %q, want kvbox's resolver's answer", server, proto, got)
			}
			if got := b.dns(server, "other.test", proto); got != "rcode=3 a=" {
				t.Errorf("other.test from %s over %s: %q, want NXDOMAIN", server, proto, got)
			}
		}
	}
	// No IPv6 at all.
	if got := b.sh(`python3 -c "
import socket
try:
    socket.create_connection(('2001:db8::10', 80), timeout=5); print('CONNECTED')
except Exception as e:
    print('NO', type(e).__name__)
"`); !strings.HasPrefix(got, "NO") {
		t.Errorf("IPv6: %q", got)
	}
}

func TestEgress(t *testing.T) {
	caPEM := setupEgressNet(t)
	src := name(t, "egsrc")
	t.Cleanup(func() { kvbox(t, "rm", "--force", src) })
	start := time.Now()
	mustKvbox(t, append(append([]string{"new", "--image", "debian", "--cpus", "1", "--memory", "1G", "--timeout", "300s"}, egDomainPolicy...), src)...)
	t.Logf("debian box up in %.1fs", time.Since(start).Seconds())
	b := egBox{t, src}
	b.prepare(caPEM)

	t.Run("domain allow-list", func(t *testing.T) { checkDomainPolicy(t, egBox{t, src}, true) })

	t.Run("in the definition and shown", func(t *testing.T) {
		x, err := virsh("dumpxml", src)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"<egress>", "<allow>allowed.test</allow>", "<allow>*.wild.test</allow>", "<deny>0.0.0.0/0</deny>"} {
			if !strings.Contains(x, want) {
				t.Errorf("dumpxml lacks %s", want)
			}
		}
		st := egressShow(t, src)
		if !st.InForce || !st.ProxyRunning || st.Dropped == 0 || !strings.Contains(strings.Join(st.Refused, "\n"), "other.test") {
			t.Errorf("egress show: %+v", st)
		}
		if out := mustKvbox(t, "egress", "show", src); !strings.Contains(out, "--egress deny-all --allow allowed.test --allow *.wild.test") {
			t.Errorf("egress show:\n%s", out)
		}
	})

	t.Run("refused with one line", func(t *testing.T) {
		for _, args := range [][]string{
			{"--deny", "evil.test"},
			{"--allow", "allowed.test"},
			{"--egress", "deny-all", "--allow", "https://allowed.test/"},
			{"--deny", "2001:db8::/32"},
		} {
			r := kvbox(t, append([]string{"egress", "set", src}, args...)...)
			if r.code == 0 || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
				t.Errorf("egress set %v: %s", args, r)
			}
		}
		checkDomainPolicy(t, egBox{t, src}, false)
	})

	t.Run("changed while it runs", func(t *testing.T) {
		pid := b.sh("setsid sleep 100000 >/dev/null 2>&1 < /dev/null & echo $!")
		before, _ := virsh("domid", src)
		mustKvbox(t, "egress", "set", src, "--egress", "deny-all", "--allow", "other.test")
		// At once: the first connection after the command meets the new
		// policy.
		if got := b.curl("https://other.test/"); !reaches(got, "other") {
			t.Errorf("other.test right after it was allowed: %q", got)
		}
		if got := b.curl("https://allowed.test/"); got != "FAIL" {
			t.Errorf("allowed.test after the new policy left it out: %q", got)
		}
		if got := b.sh("kill -0 " + pid + " && echo alive"); got != "alive" {
			t.Errorf("the guest's process %s after egress set: %q", pid, got)
		}
		if after, _ := virsh("domid", src); after != before {
			t.Errorf("the box's QEMU changed (%q, then %q)", before, after)
		}

		// A deny-list by CIDR: exactly those are blocked.
		mustKvbox(t, "egress", "set", src, "--deny", egDenyA, "--deny", egOther+"/32")
		for addr, want := range map[string]string{egDenyA: "", egOther: "", egAllowed: "allowed", egDenyB: "deny-b"} {
			got := b.curl("http://" + addr + "/")
			if want == "" && got != "FAIL" || want != "" && !reaches(got, want) {
				t.Errorf("deny-list: http://%s/: %q", addr, got)
			}
		}
		if got := b.curl("https://other.test/"); got != "FAIL" {
			t.Errorf("other.test (a denied address) passed: %q", got)
		}
		if got := b.dns(egRogue, "other.test", "udp"); got != "rcode=0 a="+egOther {
			t.Errorf("a deny-list's resolver answers every name: %q", got)
		}
		// Allow beats deny.
		mustKvbox(t, "egress", "set", src, "--deny", "198.51.100.0/24", "--allow", egAllowed)
		if got := b.curl("http://" + egAllowed + "/"); !reaches(got, "allowed") {
			t.Errorf("an allowed address inside a denied range: %q", got)
		}
		if got := b.curl("http://" + egDenyB + "/"); got != "FAIL" {
			t.Errorf("a denied range: %q", got)
		}
		// No policy: everything the network lets through.
		mustKvbox(t, "egress", "set", src, "--egress", "allow-all")
		if got := b.curl("http://" + egOther + "/"); !reaches(got, "other") {
			t.Errorf("without a policy: %q", got)
		}
		if x, _ := virsh("dumpxml", src); strings.Contains(x, "<egress>") {
			t.Error("the definition keeps a policy taken away")
		}
		mustKvbox(t, append([]string{"egress", "set", src}, egDomainPolicy...)...)
		checkDomainPolicy(t, b, false)
	})

	t.Run("suspend and resume", func(t *testing.T) {
		mustKvbox(t, "suspend", src)
		mustKvbox(t, "resume", src)
		checkDomainPolicy(t, b, false)
	})

	t.Run("the proxy restarted", func(t *testing.T) {
		// Its worker killed: the supervisor starts another, no kvbox
		// command needed.
		w := egressWorkerPid(t)
		if w == 0 {
			t.Fatal("no egress proxy worker runs")
		}
		syscall.Kill(w, syscall.SIGKILL)
		eventually(t, 30*time.Second, func() error {
			if n := egressWorkerPid(t); n == 0 || n == w {
				return fmt.Errorf("no new worker yet")
			}
			return nil
		})
		checkDomainPolicy(t, b, false)
		// The supervisor killed (its worker goes with it): the next kvbox
		// command starts them again.
		killEgressProxy(t)
		// Any kvbox command starts it again.
		if st := egressShow(t, src); !st.ProxyRunning {
			t.Fatalf("egress show after the proxy was killed: %+v", st)
		}
		checkDomainPolicy(t, b, false)
	})

	t.Run("the rules made again", func(t *testing.T) {
		// As after a host reboot: kvbox's egress table gone.
		conn, err := nftables.New()
		if err != nil {
			t.Fatal(err)
		}
		conn.DelTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "kvbox-egress"})
		if err := conn.Flush(); err != nil {
			t.Fatal(err)
		}
		if got := b.curl("http://" + egOther + "/"); !reaches(got, "other") {
			t.Fatalf("the bench: without the table the box is not held back (%q)", got)
		}
		mustKvbox(t, "network", "up", "--nat")
		checkDomainPolicy(t, b, false)
	})

	t.Run("clones", func(t *testing.T) {
		snap := name(t, "egsnap")
		t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
		mustKvbox(t, "snapshots", "new", src, snap)
		c1 := name(t, "egc1")
		t.Cleanup(func() { kvbox(t, "rm", "--force", c1) })
		mustKvbox(t, "new", "--from", snap, c1)
		if st := egressShow(t, c1); len(st.Policy.Allow) != 3 || !st.InForce {
			t.Errorf("the clone's policy: %+v", st)
		}
		checkDomainPolicy(t, egBox{t, c1}, false)

		// A clone given another policy has that one.
		c2 := name(t, "egc2")
		t.Cleanup(func() { kvbox(t, "rm", "--force", c2) })
		mustKvbox(t, "new", "--from", snap, "--egress", "deny-all", "--allow", "other.test", c2)
		cb := egBox{t, c2}
		if got := cb.curl("https://other.test/"); !reaches(got, "other") {
			t.Errorf("a clone allowed other.test: %q", got)
		}
		if got := cb.curl("https://allowed.test/"); got != "FAIL" {
			t.Errorf("a clone not allowed allowed.test: %q", got)
		}

		// Its address taken by a clone without a policy: none of c1's.
		ip := getBox(t, c1).IP
		mustKvbox(t, "rm", "--force", c1)
		c3 := name(t, "egc3")
		t.Cleanup(func() { kvbox(t, "rm", "--force", c3) })
		mustKvbox(t, "new", "--from", snap, "--egress", "allow-all", c3)
		if got := getBox(t, c3).IP; got != ip {
			t.Skipf("the new clone got %s, not %s: the address was not reused", got, ip)
		}
		if got := (egBox{t, c3}).curl("http://" + egOther + "/"); !reaches(got, "other") {
			t.Errorf("a clone on a policy box's old address is held back by its rules: %q", got)
		}
	})

	t.Run("header transform with a secret", func(t *testing.T) {
		if r := kvboxIn(t, egSecret+"\n", "secrets", "set", "egkey"); r.code != 0 || strings.Contains(r.stdout+r.stderr, egSecret) {
			t.Fatalf("secrets set: %s", r)
		}
		t.Cleanup(func() { kvbox(t, "secrets", "rm", "egkey") })
		if out := mustKvbox(t, "secrets", "ls"); !strings.Contains(out, "egkey") || strings.Contains(out, egSecret) {
			t.Errorf("secrets ls: %q", out)
		}
		// A header naming a secret the host does not have is refused.
		if r := kvbox(t, "egress", "set", src, "--egress", "deny-all", "--allow", "allowed.test", "--header", "allowed.test:Authorization=Bearer ${secret:nokey}"); r.code == 0 {
			t.Errorf("a header with a missing secret: %s", r)
		}
		mustKvbox(t, append(append([]string{"egress", "set", src}, egDomainPolicy...), "--header", "allowed.test:Authorization=Bearer ${secret:egkey}")...)
		// The box trusts the host's CA (its own trust store, no --cacert).
		if got := b.sh("curl -s -m 30 https://allowed.test/auth || echo FAIL"); got != "allowed host=allowed.test auth=ok" {
			t.Errorf("curl through the transform: %q", got)
		}
		if got := b.sh("curl -s -m 30 -H 'Authorization: Bearer mine' https://allowed.test/auth || echo FAIL"); got != "allowed host=allowed.test auth=ok" {
			t.Errorf("curl with its own Authorization: %q", got)
		}
		if got := b.sh("python3 /root/fetch.py https://allowed.test/auth default"); got != "allowed host=allowed.test auth=ok" {
			t.Errorf("urllib through the transform: %q", got)
		}
		// Another allowed name passes untouched, with its server's own
		// certificate (the test CA's), and gets no header.
		if got := b.curl("https://api.wild.test/auth"); got != "wild host=api.wild.test auth=none" {
			t.Errorf("a name without a transform: %q", got)
		}
		// The secret is nowhere a box or a snapshot keeps: not in the
		// definition, not in what egress show prints, not in a snapshot's
		// memory or disk.
		x, _ := virsh("dumpxml", src)
		if strings.Contains(x, egSecret) || !strings.Contains(x, "${secret:egkey}") {
			t.Errorf("dumpxml: the secret in it, or not its name")
		}
		if out := mustKvbox(t, "egress", "show", "--json", src); strings.Contains(out, egSecret) {
			t.Error("egress show prints the secret")
		}
		// The guest is searched from the host, in a snapshot of its memory
		// (every process's environment, the page cache) and disk: a search
		// run in the guest would put the secret there itself.
		snap := name(t, "egsecsnap")
		t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
		mustKvbox(t, "snapshots", "new", src, snap)
		files, _ := filepath.Glob(filepath.Join(stateDir, "snapshots", snap, "*"))
		if len(files) == 0 {
			t.Fatal("the snapshot has no files")
		}
		for _, f := range files {
			if out, _ := exec.Command("grep", "-c", "-a", "-F", egSecret, f).Output(); strings.TrimSpace(string(out)) != "0" {
				t.Errorf("the secret in snapshot file %s (%s)", f, strings.TrimSpace(string(out)))
			}
		}
		// The proxy's log does not hold it either.
		if data, _ := os.ReadFile(filepath.Join(stateDir, "logs", "egress-proxy.log")); strings.Contains(string(data), egSecret) {
			t.Error("the secret in the proxy's log")
		}
	})
}
