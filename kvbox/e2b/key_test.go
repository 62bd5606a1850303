package e2b

import (
	"os"
	"testing"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/statedir"
)

// The API key is made once, root's only, and read back the same; a file
// that holds no key is refused, not replaced.
func TestKey(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("kvbox serve's key is root's")
	}
	l := statedir.Layout{Root: t.TempDir()}
	key, made, err := Key(l)
	if err != nil || !made || !apiKeyRe.MatchString(key) {
		t.Fatalf("first Key: %q, made %v, %v", key, made, err)
	}
	again, made, err := Key(l)
	if err != nil || made || again != key {
		t.Fatalf("second Key: %q, made %v, %v; want %q read back", again, made, err, key)
	}
	if st, err := os.Stat(KeyPath(l)); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("key file: %v, %v; want 0600", st.Mode(), err)
	}
	if err := os.WriteFile(KeyPath(l), []byte("not a key\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Key(l); base.KindOf(err) != base.Invalid {
		t.Errorf("a file that holds no key: %v, want Invalid", err)
	}
	if b, _ := os.ReadFile(KeyPath(l)); string(b) != "not a key\n" {
		t.Errorf("the file that held no key was rewritten: %q", b)
	}
}
