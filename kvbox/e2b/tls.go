package e2b

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/statedir"
)

// kvbox serve over TLS: with the operator's certificate (--tls-cert,
// --tls-key), or with one of a CA kvbox makes for the host (--tls), whose
// certificate clients trust (NODE_EXTRA_CA_CERTS, SSL_CERT_FILE, the
// system's store). That CA is name-constrained to the sandbox domain and
// the loopback addresses: trusting it trusts nothing else. Its key stays
// root's only in STATE/serve/tls/.

// CACertPath is the certificate (PEM) of the CA kvbox serve's --tls makes
// for sandbox domain host, in the state dir l: what clients trust.
func CACertPath(l statedir.Layout, host string) string {
	return filepath.Join(tlsDir(l, host), "ca.crt")
}

func tlsDir(l statedir.Layout, host string) string { return filepath.Join(l.Serve(), "tls", host) }

func caKeyPath(l statedir.Layout, host string) string {
	return filepath.Join(tlsDir(l, host), "ca.key")
}

// loopbacks are the addresses the made CA may sign for besides the domain.
var loopbacks = []*net.IPNet{
	{IP: net.IPv4(127, 0, 0, 0).To4(), Mask: net.CIDRMask(8, 32)},
	{IP: net.IPv6loopback, Mask: net.CIDRMask(128, 128)},
}

// domainHost is the sandbox domain without its port, checked: the name
// the certificates are for.
func domainHost(domain string) (string, error) {
	h := domain
	if host, _, err := net.SplitHostPort(domain); err == nil {
		h = host
	}
	h = strings.ToLower(strings.TrimSuffix(h, "."))
	if h == "" || net.ParseIP(h) != nil || strings.ContainsAny(h, "/\\*") || strings.HasPrefix(h, ".") || strings.Contains(h, "..") {
		return "", base.Errorf(base.Invalid, "sandbox domain %q: --tls needs a DNS name (PORT-ID.DOMAIN must be a name a certificate can hold)", domain)
	}
	return h, nil
}

// ensureCA reads the CA made for domain host, or makes it (10 years, name
// constrained to host and its subdomains, and the loopback addresses).
func ensureCA(l statedir.Layout, host string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	certPath, keyPath := CACertPath(l, host), caKeyPath(l, host)
	if cb, err := os.ReadFile(certPath); err == nil {
		kb, err := os.ReadFile(keyPath)
		if err != nil {
			return nil, nil, fmt.Errorf("kvbox serve's CA %s: its key: %w", certPath, err)
		}
		return parseCA(cb, kb)
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, nil, err
	}
	if err := os.MkdirAll(tlsDir(l, host), 0o700); err != nil {
		return nil, nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	machine, _ := os.Hostname()
	tmpl := &x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: "kvbox serve CA for " + host + " on " + machine, Organization: []string{"kvbox"}},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().AddDate(10, 0, 0), IsCA: true, BasicConstraintsValid: true,
		MaxPathLenZero: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		PermittedDNSDomainsCritical: true, PermittedDNSDomains: []string{host}, PermittedIPRanges: loopbacks}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	// The key first: a CA certificate is never there without its key.
	if err := overlay.WriteFileAtomic(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		return nil, nil, err
	}
	if err := overlay.WriteFileAtomic(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	return ca, key, err
}

func parseCA(cb, kb []byte) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cp, _ := pem.Decode(cb)
	kp, _ := pem.Decode(kb)
	if cp == nil || kp == nil {
		return nil, nil, errors.New("kvbox serve's CA: not PEM")
	}
	ca, err := x509.ParseCertificate(cp.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("kvbox serve's CA: %w", err)
	}
	key, err := x509.ParseECPrivateKey(kp.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("kvbox serve's CA key: %w", err)
	}
	return ca, key, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

// leafIssuer hands out serve's certificate from the made CA: one for the
// domain, *.domain (every PORT-ID host getHost names) and the loopback
// addresses, made anew a day before it expires.
type leafIssuer struct {
	host string
	ca   *x509.Certificate
	key  *ecdsa.PrivateKey

	mu   sync.Mutex
	leaf *tls.Certificate
}

func (is *leafIssuer) get(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	is.mu.Lock()
	defer is.mu.Unlock()
	if is.leaf != nil && time.Now().Before(is.leaf.Leaf.NotAfter.Add(-24*time.Hour)) {
		return is.leaf, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: is.host},
		DNSNames: []string{is.host, "*." + is.host}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(30 * 24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, is.ca, &key.PublicKey, is.key)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	is.leaf = &tls.Certificate{Certificate: [][]byte{der, is.ca.Raw}, PrivateKey: key, Leaf: leaf}
	return is.leaf, nil
}

// TLS says how kvbox serve serves TLS: the operator's certificate and key
// files (PEM), or with Auto one of the CA kvbox makes for the host.
type TLS struct {
	CertFile, KeyFile string
	Auto              bool
}

// On says TLS is asked for.
func (t TLS) On() bool { return t.Auto || t.CertFile != "" || t.KeyFile != "" }

// config is the TLS configuration for sandbox domain, and the CA
// certificate's path when kvbox made it.
func (t TLS) config(l statedir.Layout, domain string) (*tls.Config, string, error) {
	switch {
	case t.Auto && (t.CertFile != "" || t.KeyFile != ""):
		return nil, "", base.Errorf(base.Invalid, "--tls makes kvbox's own certificate; --tls-cert and --tls-key give yours: one or the other")
	case (t.CertFile == "") != (t.KeyFile == ""):
		return nil, "", base.Errorf(base.Invalid, "--tls-cert and --tls-key go together")
	case t.CertFile != "":
		c, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, "", base.Errorf(base.Invalid, "--tls-cert %s, --tls-key %s: %v", t.CertFile, t.KeyFile, err)
		}
		return &tls.Config{Certificates: []tls.Certificate{c}, MinVersion: tls.VersionTLS12}, "", nil
	}
	host, err := domainHost(domain)
	if err != nil {
		return nil, "", err
	}
	ca, key, err := ensureCA(l, host)
	if err != nil {
		return nil, "", err
	}
	is := &leafIssuer{host: host, ca: ca, key: key}
	return &tls.Config{GetCertificate: is.get, MinVersion: tls.VersionTLS12}, CACertPath(l, host), nil
}
