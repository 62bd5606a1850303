//go:build e2e

package testenv

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/miekg/dns"

	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
)

// resolverAddr is where wildcardResolver listens: a loopback address of
// its own, port 53 (the only one /etc/resolv.conf can name), in the
// test's network namespace.
const resolverAddr = "127.77.0.53"

// wildcardResolver answers A queries for domain and every name under it
// with 127.0.0.1, on resolverAddr: what a dnsmasq
// `address=/DOMAIN/127.0.0.1` line does for the host's resolver
// (docs/e2b.md). Other names get no answer.
func wildcardResolver(t *testing.T, domain string) {
	t.Helper()
	pc, err := net.ListenPacket("udp", resolverAddr+":53")
	if err != nil {
		t.Fatalf("a resolver on %s:53 in the test's namespace: %v", resolverAddr, err)
	}
	zone := dns.Fqdn(domain)
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		for _, qu := range q.Question {
			name := strings.ToLower(qu.Name)
			if name != zone && !strings.HasSuffix(name, "."+zone) {
				m.Rcode = dns.RcodeNameError
				continue
			}
			m.Authoritative = true
			if qu.Qtype == dns.TypeA {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: qu.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 5}, A: net.IPv4(127, 0, 0, 1)})
			}
		}
		w.WriteMsg(m)
	})
	srv := &dns.Server{PacketConn: pc, Handler: h}
	go srv.ActivateAndServe()
	t.Cleanup(func() { srv.Shutdown() })
}

// tlsStep: kvbox serve --tls on serve's address, and the unmodified SDK
// with nothing but its defaults for the sandbox's traffic (no
// E2B_SANDBOX_URL: envd at https://49983-ID.DOMAIN, a port at
// https://getHost(PORT)), its names resolved by the system's resolver
// (the test's wildcard, in a mount namespace of node's own where
// /etc/resolv.conf names it) and serve's certificate verified against the
// CA kvbox made (NODE_EXTRA_CA_CERTS).
func tlsStep(t *testing.T, addr, template, page string) {
	repo, _ := filepath.Abs("..")
	p := startServe(t, addr, "--", "--tls")
	ca := filepath.Join(stateDir, "serve", "tls", "kvbox.localhost", "ca.crt")
	if _, err := os.Stat(ca); err != nil {
		t.Fatalf("serve --tls made no CA: %v\n%s", err, p.out)
	}
	wildcardResolver(t, "kvbox.localhost")
	dir := t.TempDir()
	resolv := filepath.Join(dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver "+resolverAddr+"\noptions attempts:1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	key := strings.TrimSpace(mustKvbox(t, "serve", "key"))
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
		`mount --bind "$1" /etc/resolv.conf && exec node "$2"`, "sh", resolv, filepath.Join(envdtest.Dir(repo), "serve-tls.mjs"))
	cmd.Dir = dir
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); !strings.HasPrefix(k, "E2B_") && !strings.HasPrefix(strings.ToUpper(k), "HTTP") && k != "NO_PROXY" {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env, "E2B_SDK_DIR="+filepath.Join(envdtest.Dir(repo), envdtest.Versions[0]),
		"E2B_API_URL=https://"+p.addr, "E2B_API_KEY="+key, "NODE_EXTRA_CA_CERTS="+ca,
		"KVBOX_TEMPLATE="+template, "KVBOX_TEMPLATE_PAGE="+page, "KVBOX_SERVE_ADDR="+p.addr)
	out, err := cmd.CombinedOutput()
	t.Logf("node serve-tls.mjs (e2b@%s):\n%s", envdtest.Versions[0], out)
	if err != nil {
		t.Errorf("the JS SDK over kvbox serve --tls: %v", err)
	}

	// The newest Python SDK, whose transport trusts the system's store
	// (SSL_CERT_FILE) and negotiates HTTP/2.
	vs := pyVersions(t)
	v := vs[len(vs)-1]
	py := exec.Command("unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
		`mount --bind "$1" /etc/resolv.conf && exec "$2" -I "$3"`, "sh", resolv, filepath.Join(pyVenv(v), "bin", "python"), filepath.Join(repo, "testenv", "e2b-py", "serve_tls.py"))
	py.Dir = dir
	var pyEnv []string
	for _, kv := range cmd.Env {
		if k, _, _ := strings.Cut(kv, "="); !strings.HasPrefix(k, "PYTHON") && k != "HOME" && k != "NODE_EXTRA_CA_CERTS" {
			pyEnv = append(pyEnv, kv)
		}
	}
	py.Env = append(pyEnv, "HOME="+t.TempDir(), "PYTHONDONTWRITEBYTECODE=1", "SSL_CERT_FILE="+ca)
	out, err = py.CombinedOutput()
	t.Logf("python serve_tls.py (e2b %s):\n%s", v, out)
	if err != nil {
		t.Errorf("the Python SDK over kvbox serve --tls: %v", err)
	}
}
