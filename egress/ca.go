package egress

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
	"os"
	"path/filepath"
	"sync"
	"time"
)

// The host's egress CA: the proxy terminates TLS with a certificate of its
// own, for a name with a header transform only, and the boxes that have
// such a transform trust this CA (its certificate is put in the guest's
// trust store). The key stays on the host, root's only, in
// STATE/egress/ca/ca.key.

func caDir(root string) string { return filepath.Join(Dir(root), "ca") }

// CACertFile is the host's egress CA certificate (PEM).
func CACertFile(root string) string { return filepath.Join(caDir(root), "ca.crt") }

func caKeyFile(root string) string { return filepath.Join(caDir(root), "ca.key") }

// EnsureCA makes the host's egress CA unless it is there, and returns its
// certificate (PEM).
func EnsureCA(root string) ([]byte, error) {
	if b, err := os.ReadFile(CACertFile(root)); err == nil {
		if _, err := os.Stat(caKeyFile(root)); err == nil {
			return b, nil
		}
	}
	if err := os.MkdirAll(caDir(root), 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	host, _ := os.Hostname()
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: "kvbox egress CA " + host, Organization: []string{"kvbox"}},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().AddDate(10, 0, 0), IsCA: true, BasicConstraintsValid: true,
		MaxPathLenZero: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := writeFile0600(caKeyFile(root), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})); err != nil {
		return nil, err
	}
	if err := writeFile0600(CACertFile(root), certPEM); err != nil {
		return nil, err
	}
	return certPEM, nil
}

func writeFile0600(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err = f.Write(data); err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	return err
}

// issuer signs the proxy's certificates for names, cached per name.
type issuer struct {
	root string
	mu   sync.Mutex
	ca   *x509.Certificate
	key  *ecdsa.PrivateKey
	leaf map[string]*tls.Certificate
}

func (is *issuer) load() error {
	if is.ca != nil {
		return nil
	}
	cb, err := os.ReadFile(CACertFile(is.root))
	if err != nil {
		return fmt.Errorf("egress CA: %w", err)
	}
	kb, err := os.ReadFile(caKeyFile(is.root))
	if err != nil {
		return fmt.Errorf("egress CA: %w", err)
	}
	cp, _ := pem.Decode(cb)
	kp, _ := pem.Decode(kb)
	if cp == nil || kp == nil {
		return errors.New("egress CA: not PEM")
	}
	ca, err := x509.ParseCertificate(cp.Bytes)
	if err != nil {
		return err
	}
	key, err := x509.ParseECPrivateKey(kp.Bytes)
	if err != nil {
		return err
	}
	is.ca, is.key, is.leaf = ca, key, map[string]*tls.Certificate{}
	return nil
}

// cert is the certificate for name.
func (is *issuer) cert(name string) (*tls.Certificate, error) {
	is.mu.Lock()
	defer is.mu.Unlock()
	if err := is.load(); err != nil {
		return nil, err
	}
	if c, ok := is.leaf[name]; ok && time.Now().Before(c.Leaf.NotAfter.Add(-time.Hour)) {
		return c, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(7 * 24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, is.ca, &key.PublicKey, is.key)
	if err != nil {
		return nil, err
	}
	leaf, _ := x509.ParseCertificate(der)
	c := &tls.Certificate{Certificate: [][]byte{der, is.ca.Raw}, PrivateKey: key, Leaf: leaf}
	is.leaf[name] = c
	return c, nil
}
