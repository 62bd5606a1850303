package domain

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	agent "kvbox.dev/kvbox/guest-agent"
)

func tokenOf(c byte) []byte { return bytes.Repeat([]byte{c}, agent.TokenSize) }

func kinds(ts []agentToken) []string {
	var out []string
	for _, t := range ts {
		out = append(out, t.kind)
	}
	return out
}

// The token the agent had before its current one stays, tried last: the
// agent may find it on its disk again after a power-off.
func TestAgentTokenRotationKeepsThePreviousOne(t *testing.T) {
	dir := t.TempDir()
	b := Box{Name: "b"}
	b.Dir = dir
	p := filepath.Join(dir, AgentTokenFile)

	// A folder with a previous token alone is not one kvbox leaves: no
	// token, a first contact.
	if err := os.WriteFile(p+tokenOld, tokenOf(9), 0o600); err != nil {
		t.Fatal(err)
	}
	if ts, err := readAgentTokens(dir); err != nil || len(ts) != 1 || ts[0].tok != nil {
		t.Fatalf("previous token alone: %v %v", kinds(ts), err)
	}
	os.Remove(p + tokenOld)

	// A clone's folder: the snapshot's token as its own, then a new one
	// given to its agent.
	if err := os.WriteFile(p, tokenOf(1), 0o600); err != nil {
		t.Fatal(err)
	}
	tok, err := newAgentToken(b)
	if err != nil {
		t.Fatal(err)
	}
	ts, _ := readAgentTokens(dir)
	if !unsettled(ts) || kinds(ts)[0] != tokenNew {
		t.Fatalf("while the new one is given: %v", kinds(ts))
	}
	if err := keepNewToken(b); err != nil {
		t.Fatal(err)
	}
	ts, err = readAgentTokens(dir)
	if err != nil || len(ts) != 2 || ts[0].kind != tokenCurrent || !bytes.Equal(ts[0].tok, tok) ||
		ts[1].kind != tokenOld || !bytes.Equal(ts[1].tok, tokenOf(1)) {
		t.Fatalf("after the new one was kept: %v %v", kinds(ts), err)
	}
	if unsettled(ts) {
		t.Errorf("a current and a previous token are settled: %v", kinds(ts))
	}
	if got := AgentTokens(dir); len(got) != 1 || !bytes.Equal(got[0], tok) {
		t.Errorf("AgentTokens %x: want the current one only (never the previous)", got)
	}

	// The next change: the previous becomes what was current.
	tok2, _ := newAgentToken(b)
	if err := keepNewToken(b); err != nil {
		t.Fatal(err)
	}
	ts, _ = readAgentTokens(dir)
	if len(ts) != 2 || !bytes.Equal(ts[0].tok, tok2) || !bytes.Equal(ts[1].tok, tok) {
		t.Fatalf("after a second change: %v", kinds(ts))
	}
	if fi, err := os.Stat(p + tokenOld); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the previous token's file: %v %v", fi, err)
	}
}
