package e2b

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/statedir"
)

var apiKeyRe = regexp.MustCompile(`^e2b_[0-9a-f]{40}$`)

// KeyPath is the file of kvbox serve's API key in the state dir l.
func KeyPath(l statedir.Layout) string { return filepath.Join(l.Serve(), "api-key") }

// Key reads kvbox serve's API key in the state dir l, or makes one (e2b_
// and 40 hex digits: every SDK version's check takes it) root's only; made
// says it was made now.
func Key(l statedir.Layout) (key string, made bool, err error) {
	if os.Geteuid() != 0 {
		return "", false, base.Errorf(base.Unavailable, "kvbox serve's key is root's: run it as root")
	}
	dir := l.Serve()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", false, err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return "", false, err
	}
	path := KeyPath(l)
	key, err = readKey(path)
	if !errors.Is(err, os.ErrNotExist) {
		return key, false, err
	}
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		return "", false, err
	}
	key = "e2b_" + hex.EncodeToString(b)
	if err := overlay.WriteFileAtomic(path, []byte(key+"\n"), 0o600); err != nil {
		return "", false, err
	}
	return key, true, nil
}

// readKey reads the key at path, made root's only; a file that holds no
// key is refused.
func readKey(path string) (string, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if err := f.Chmod(0o600); err != nil {
		return "", err
	}
	b, err := io.ReadAll(io.LimitReader(f, 256))
	if err != nil {
		return "", err
	}
	key := strings.TrimSpace(string(b))
	if !apiKeyRe.MatchString(key) {
		return "", base.Errorf(base.Invalid, "%s does not hold an API key (e2b_ and 40 hex digits): remove it and kvbox serve key makes one", path)
	}
	return key, nil
}
