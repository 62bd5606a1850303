//go:build e2e

package testenv

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"

	"kvbox.dev/kvbox/domain"
)

// blobData is what a pushed part holds: its blob in the test registry's
// storage, decompressed (the extent map and the bytes of every extent).
func blobData(t *testing.T, digest string) []byte {
	t.Helper()
	hex := strings.TrimPrefix(digest, "sha256:")
	f, err := os.Open(filepath.Join(testRegistryData, "sha256", hex[:2], hex, "data"))
	if err != nil {
		t.Fatalf("blob %s: %v", digest, err)
	}
	defer f.Close()
	zr, err := zstd.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	defer zr.Close()
	b, err := io.ReadAll(zr)
	if err != nil {
		t.Fatalf("blob %s: %v", digest, err)
	}
	return b
}

// TestSnapshotTokensLeaveNoLiveToken: a pushed artifact holds no token a
// box uses: the token in its memory and its token file is the snapshot's
// own, which the source replaced right after the snapshot and each clone at
// its first contact; the blobs, read back from the registry, hold neither
// the source's token nor a clone's. A box's published port keeps working
// across a snapshot, whose new token ends the port holder's rights: the
// holder presents the box's new one.
func TestSnapshotTokensLeaveNoLiveToken(t *testing.T) {
	needRegistry(t)
	src := name(t, "toksrc")
	newBox(t, src, "--publish", "0:8000")
	pub := publishedOf(t, src)
	if len(pub) != 1 {
		t.Fatalf("published = %v", pub)
	}
	page, _ := startWebServer(t, src, 8000)
	if b, err := fwdGet("http://" + pub[0] + "/index.html"); err != nil || string(b) != page {
		t.Fatalf("through the published port before the snapshot: %q %v", b, err)
	}

	snap := name(t, "toksnap")
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)
	if b, err := fwdGet("http://" + pub[0] + "/index.html"); err != nil || string(b) != page {
		t.Errorf("through the published port after the snapshot (the holder's rights ended with the old token): %q %v", b, err)
	}
	cn := name(t, "tokclone")
	if r := newClone(t, snap, cn); r.code != 0 {
		t.Fatalf("clone: %s", r)
	}

	stok, err := domain.ReadAgentToken(filepath.Join(stateDir, "snapshots", snap))
	if err != nil || stok == nil {
		t.Fatalf("the snapshot's token: %v", err)
	}
	live := map[string][]byte{}
	for _, n := range []string{src, cn} {
		tok, err := domain.ReadAgentToken(getBox(t, n).Dir)
		if err != nil || tok == nil {
			t.Fatalf("box %s's token: %v", n, err)
		}
		if bytes.Equal(tok, stok) {
			t.Errorf("box %s uses the snapshot's token", n)
		}
		live[n] = tok
	}

	res := push(t, nil, snap, testRegistry+"/sec-misc/"+runID+"-tok:v1")
	sawToken := false
	for _, p := range res.Parts {
		data := blobData(t, p.Digest)
		for n, tok := range live {
			if bytes.Contains(data, tok) {
				t.Errorf("the pushed part %s holds box %s's agent token", p.Title, n)
			}
		}
		if p.Title == "snapshot/"+domain.AgentTokenFile {
			sawToken = true
			if !bytes.HasSuffix(data, stok) {
				t.Errorf("the pushed token file is not the snapshot's own token")
			}
		}
	}
	if !sawToken {
		t.Errorf("the artifact carries no token for a clone's first contact: parts %+v", res.Parts)
	}
	t.Logf("%d parts read back from the registry", len(res.Parts))
}
