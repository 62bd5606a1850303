package snapshot

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
)

// A clone's folder gets its snapshot's agent token, root's only; a
// snapshot without one is refused in one line (its clone's first contact
// would present none).
func TestCopyAgentToken(t *testing.T) {
	snap, clone := t.TempDir(), t.TempDir()
	err := copyAgentToken(snap, clone)
	if err == nil || !strings.Contains(err.Error(), "no agent token") || strings.Contains(err.Error(), "\n") {
		t.Errorf("a snapshot without a token: %v", err)
	}
	if _, err := os.Stat(filepath.Join(clone, domain.AgentTokenFile)); !os.IsNotExist(err) {
		t.Errorf("a token file made from no token: %v", err)
	}
	tok := bytes.Repeat([]byte{7}, agent.TokenSize)
	if err := os.WriteFile(filepath.Join(snap, domain.AgentTokenFile), tok, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := copyAgentToken(snap, clone); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(clone, domain.AgentTokenFile))
	got, _ := os.ReadFile(filepath.Join(clone, domain.AgentTokenFile))
	if err != nil || !bytes.Equal(got, tok) || fi.Mode().Perm() != 0o600 {
		t.Errorf("the clone's token: %x %v %v", got, fi, err)
	}
}
