package egress

import (
	"errors"
	"fmt"
	"net/textproto"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"kvbox.dev/kvbox/base"
)

// Secrets are values kept on the host, root's only, that a policy's
// header transforms name (${secret:NAME}): the proxy reads one when it
// sets a header on a request, and it never enters a box, a box's
// definition, a snapshot or a log.

func secretsDir(root string) string { return filepath.Join(Dir(root), "secrets") }

var secretName = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,63}$`)

// ValidSecretName checks a secret's name.
func ValidSecretName(n string) error {
	if !secretName.MatchString(n) {
		return base.Errorf(base.Invalid, "secret name %q: give 1 to 64 of a-z 0-9 _ . - (starting with a letter or digit)", n)
	}
	return nil
}

// SetSecret keeps value as secret name (one trailing newline, as a file
// read from stdin ends, is dropped).
func SetSecret(root, name string, value []byte) error {
	if err := ValidSecretName(name); err != nil {
		return err
	}
	v := strings.TrimSuffix(strings.TrimSuffix(string(value), "\n"), "\r")
	if v == "" {
		return base.Errorf(base.Invalid, "secret %q: the value is empty (give it on stdin)", name)
	}
	if strings.ContainsAny(v, "\r\n\x00") {
		return base.Errorf(base.Invalid, "secret %q: a header value cannot hold a line break or NUL", name)
	}
	if err := os.MkdirAll(secretsDir(root), 0o700); err != nil {
		return err
	}
	os.Chmod(secretsDir(root), 0o700)
	f, err := os.CreateTemp(secretsDir(root), ".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err = f.WriteString(v); err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), filepath.Join(secretsDir(root), name))
	}
	return err
}

// Secret reads secret name.
func Secret(root, name string) (string, error) {
	if err := ValidSecretName(name); err != nil {
		return "", err
	}
	b, err := os.ReadFile(filepath.Join(secretsDir(root), name))
	if errors.Is(err, os.ErrNotExist) {
		return "", base.Errorf(base.NotFound, "no secret %q (kvbox secrets set %s)", name, name)
	}
	return string(b), err
}

// Secrets lists the secrets' names.
func Secrets(root string) ([]string, error) {
	ents, err := os.ReadDir(secretsDir(root))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	var out []string
	for _, e := range ents {
		if ValidSecretName(e.Name()) == nil && e.Type().IsRegular() {
			out = append(out, e.Name())
		}
	}
	slices.Sort(out)
	return out, err
}

// RemoveSecret removes secret name.
func RemoveSecret(root, name string) error {
	if err := ValidSecretName(name); err != nil {
		return err
	}
	err := os.Remove(filepath.Join(secretsDir(root), name))
	if errors.Is(err, os.ErrNotExist) {
		return base.Errorf(base.NotFound, "no secret %q", name)
	}
	return err
}

var secretRef = regexp.MustCompile(`\$\{secret:([^}]*)\}`)

// forbiddenHeaders are headers the proxy itself owns on a request.
var forbiddenHeaders = []string{"Host", "Content-Length", "Transfer-Encoding", "Connection", "Upgrade", "Te", "Trailer", "Proxy-Connection", "Keep-Alive"}

// parseHeader reads HOST:NAME=VALUE.
func parseHeader(s string) (Header, error) {
	bad := func(format string, a ...any) error {
		return base.Errorf(base.Invalid, "--header %q: %s", s, fmt.Sprintf(format, a...))
	}
	host, rest, ok := strings.Cut(s, ":")
	name, value, ok2 := strings.Cut(rest, "=")
	if !ok || !ok2 {
		return Header{}, bad("give HOST:NAME=VALUE, like api.openai.com:Authorization=Bearer ${secret:openai}")
	}
	h, err := parseRule(strings.TrimSpace(host), true)
	if err != nil {
		return Header{}, bad("%v", err)
	}
	if strings.Contains(h, "/") {
		return Header{}, bad("a header goes with a host name, not an address: it is set by the proxy, which matches names")
	}
	hd := Header{Host: h, Name: textproto.CanonicalMIMEHeaderKey(strings.TrimSpace(name)), Value: value}
	if err := checkHeader(hd); err != nil {
		return Header{}, err
	}
	return hd, nil
}

// checkHeader checks one transform's name and value.
func checkHeader(h Header) error {
	bad := func(format string, a ...any) error {
		return base.Errorf(base.Invalid, "--header %s:%s: %s", h.Host, h.Name, fmt.Sprintf(format, a...))
	}
	if h.Name == "" || strings.ContainsFunc(h.Name, func(r rune) bool {
		return r <= ' ' || r >= 0x7f || strings.ContainsRune("()<>@,;:\\\"/[]?={}", r)
	}) {
		return bad("not a header name")
	}
	if slices.Contains(forbiddenHeaders, h.Name) {
		return bad("the proxy keeps %s as the box sent it", h.Name)
	}
	if strings.ContainsAny(h.Value, "\r\n\x00") {
		return bad("a value cannot hold a line break or NUL")
	}
	for _, m := range secretRef.FindAllStringSubmatch(h.Value, -1) {
		if err := ValidSecretName(m[1]); err != nil {
			return bad("%v", err)
		}
	}
	if strings.Contains(secretRef.ReplaceAllString(h.Value, ""), "${") {
		return bad("${...} names a secret only as ${secret:NAME}")
	}
	return nil
}

// Resolve is h's value with its secrets read from root's store.
func (h Header) Resolve(root string) (string, error) {
	var err error
	v := secretRef.ReplaceAllStringFunc(h.Value, func(m string) string {
		n := secretRef.FindStringSubmatch(m)[1]
		s, e := Secret(root, n)
		if e != nil && err == nil {
			err = e
		}
		return s
	})
	return v, err
}
