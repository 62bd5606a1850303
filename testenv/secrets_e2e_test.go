//go:build e2e

package testenv

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/guest-agent/envd/envdtest"
)

// blobScan is what scanBlobs found under a folder: which needles, where,
// and every run of exactly 64 lowercase hex digits (the shape of a
// sandbox's access token), up to a bound.
type blobScan struct {
	found      map[string][]string // needle -> files
	candidates map[string]bool
	bytes      int64
}

// maxCandidates bounds the tokens harvested from one scan: each is tried
// against serve.
const maxCandidates = 50000

// scanBlobs reads every regular file under root as a stream and looks for
// each needle, and harvests token-shaped runs when harvest is set.
func scanBlobs(t *testing.T, root string, needles []string, harvest bool) blobScan {
	t.Helper()
	sc := blobScan{found: map[string][]string{}, candidates: map[string]bool{}}
	const chunk = 8 << 20
	overlap := 64
	for _, n := range needles {
		overlap = max(overlap, len(n))
	}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		buf := make([]byte, overlap+chunk)
		keep := 0 // bytes carried over from the previous chunk
		seen := map[string]bool{}
		for {
			n, rerr := io.ReadFull(f, buf[keep:])
			data := buf[:keep+n]
			sc.bytes += int64(n)
			for _, nd := range needles {
				if !seen[nd] && bytes.Contains(data, []byte(nd)) {
					seen[nd] = true
					sc.found[nd] = append(sc.found[nd], path)
				}
			}
			last := rerr != nil
			if harvest {
				harvestTokens(data, last, keep, sc.candidates)
			}
			if last {
				if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
					return nil
				}
				return rerr
			}
			keep = min(overlap, len(data))
			copy(buf, data[len(data)-keep:])
		}
	})
	if err != nil {
		t.Fatalf("scan %s: %v", root, err)
	}
	return sc
}

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' }

// harvestTokens adds each run of exactly 64 hex digits in data to out. A
// run that touches the chunk's end is left for the next chunk (which
// starts with the carried-over tail), unless this is the last; one that
// ends inside the carried-over head was seen already.
func harvestTokens(data []byte, last bool, carried int, out map[string]bool) {
	for i := 0; i < len(data); {
		if !isHex(data[i]) {
			i++
			continue
		}
		j := i
		for j < len(data) && isHex(data[j]) {
			j++
		}
		if j == len(data) && !last {
			return
		}
		if j-i == 64 && j > carried && len(out) < maxCandidates {
			out[string(data[i:j])] = true
		}
		i = j
	}
}

// secretsStep: what a snapshot copies opens nothing. A sandbox with
// envVars uses its token (a command, a file, a signed download), is
// snapshotted and forked, and a sandbox is made from the snapshot
// (serve-secrets.mjs, the unmodified SDK); then no blob of the snapshot or
// of the fork's (state file, disk), nor the pushed artifact pulled back,
// holds the source's token or its URL's signature; and no token-shaped
// string in the clone's memory or disk (all of its RAM, as a snapshot of
// it has it) opens any sandbox through serve; each sandbox's own handle
// works on.
func secretsStep(t *testing.T, p *serveProc, template, page string) {
	repo, _ := filepath.Abs("..")
	v := envdtest.Versions[0]
	state := filepath.Join(t.TempDir(), "state.json")
	script := filepath.Join(envdtest.Dir(repo), "serve-secrets.mjs")
	if err := runNode(t, v, p, template, page, []string{"KVBOX_PHASE=make", "KVBOX_STATE_FILE=" + state}, script); err != nil {
		t.Fatalf("make: %v", err)
	}
	var st struct {
		Source, Clone struct{ ID, Token string }
		Fork          *struct{ ID, Token string }
		Snapshot      string
		SignedURL     string
	}
	b, _ := os.ReadFile(state)
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// What the after phase did not remove.
		kvbox(t, "rm", "--force", st.Source.ID, st.Clone.ID)
		if st.Fork != nil {
			kvbox(t, "rm", "--force", st.Fork.ID)
		}
		kvbox(t, "snapshots", "rm", st.Snapshot)
	})
	u, err := url.Parse(st.SignedURL)
	if err != nil {
		t.Fatal(err)
	}
	sig := u.Query().Get("signature")
	if st.Source.Token == "" || sig == "" {
		t.Fatalf("the make phase handed over %s", b)
	}
	clientTokens := []string{st.Source.Token, st.Clone.Token}
	if st.Fork != nil {
		clientTokens = append(clientTokens, st.Fork.Token)
	}
	noSecrets := func(what, dir string) blobScan {
		sc := scanBlobs(t, dir, []string{st.Source.Token, sig}, true)
		t.Logf("%s: %d bytes read, %d token-shaped strings", what, sc.bytes, len(sc.candidates))
		if len(sc.candidates) >= maxCandidates {
			t.Errorf("%s: more token-shaped strings than the scan keeps (%d): what it did not keep goes unchecked", what, maxCandidates)
		}
		if sc.bytes == 0 {
			t.Errorf("%s: nothing to scan in %s", what, dir)
		}
		for nd, files := range sc.found {
			t.Errorf("%s holds the source sandbox's %s: %v", what, map[bool]string{true: "access token", false: "signed URL's signature"}[nd == st.Source.Token], files)
		}
		return sc
	}
	snaps := filepath.Join(stateDir, "snapshots")
	inSnapshot := noSecrets("the snapshot "+st.Snapshot, filepath.Join(snaps, st.Snapshot)).candidates

	// The guest's own envd token, minted again on the source after the
	// copy and in every clone at its identity: neither is in the
	// snapshot. A clone made without kvbox serve (as kvbox-node's and the
	// CLI's are, with no envd-init) too.
	localToken := func(box string) string {
		return strings.TrimSpace(mustKvbox(t, "exec", box, "--", "cat", "/var/lib/kvbox-agent/"+agent.EnvdTokenFile))
	}
	plain := name(t, "plainclone")
	mustKvbox(t, "new", "--from", st.Snapshot, plain)
	t.Cleanup(func() { kvbox(t, "rm", "--force", plain) })
	for _, box := range []string{st.Source.ID, st.Clone.ID, plain} {
		if tok := localToken(box); len(tok) != 64 || inSnapshot[tok] {
			t.Errorf("box %s's local envd token %q is the snapshot's (or none): it was not minted again", box, tok)
		}
	}
	kvbox(t, "rm", "--force", plain)
	if st.Fork != nil {
		fb := getBox(t, st.Fork.ID)
		noSecrets("the fork's snapshot "+fb.Snapshot, filepath.Join(snaps, fb.Snapshot))
	}

	// The pushed artifact, as a second host pulls it.
	needRegistry(t)
	ref := testRegistry + "/" + registryRepo + "/secrets-" + runID + ":v1"
	push(t, nil, st.Snapshot, ref)
	h2 := host2(t, "s", freeSubnet(t))
	pulled := name(t, "spulled")
	mustKvbox(t, append(h2, "snapshots", "pull", "--insecure", ref, pulled)...)
	noSecrets("the pushed artifact, pulled", filepath.Join(dirOf(h2), "snapshots", pulled))
	kvbox(t, append(h2, "snapshots", "rm", pulled)...)

	// Everything the clone holds: its RAM whole and its disk, as a
	// snapshot of it has them.
	scan := name(t, "cscan")
	mustKvbox(t, "snapshots", "new", st.Clone.ID, scan)
	sc := scanBlobs(t, filepath.Join(snaps, scan), []string{st.Source.Token, sig}, true)
	kvbox(t, "snapshots", "rm", scan)
	for nd, files := range sc.found {
		t.Errorf("the clone's memory or disk holds the source's %q: %v", nd[:8], files)
	}
	t.Logf("the clone's memory and disk: %d bytes, %d token-shaped strings", sc.bytes, len(sc.candidates))
	if len(sc.candidates) >= maxCandidates {
		t.Errorf("more token-shaped strings in the clone than the scan keeps (%d): what it did not keep goes untried", maxCandidates)
	}
	if len(sc.candidates) == 0 {
		t.Errorf("no token-shaped string at all in the clone's memory and disk: the scan found nothing to try (the agent's own local token is one)")
	}
	for _, tok := range clientTokens {
		if sc.candidates[tok] {
			t.Errorf("a client's token (%s...) is in the clone", tok[:8])
		}
	}
	// Each one, tried as a header-less /files (serve tries it against
	// every sandbox's token) and as the source's token on its envd.
	client := &http.Client{}
	opened := 0
	for tok := range sc.candidates {
		for _, h := range []map[string]string{{}, {"E2b-Sandbox-Id": st.Source.ID}} {
			req, _ := http.NewRequest("GET", "http://"+p.addr+"/files?path=/etc/hostname", nil)
			req.Header.Set("X-Access-Token", tok)
			for k, v := range h {
				req.Header.Set(k, v)
			}
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized {
				opened++
				if opened < 5 {
					t.Errorf("a token found in the clone (%s...) with %v: %d, want 401", tok[:8], h, resp.StatusCode)
				}
			}
		}
	}
	if opened > 0 {
		t.Errorf("%d tokens found in the clone opened a sandbox", opened)
	}

	if err := runNode(t, v, p, template, page, []string{"KVBOX_PHASE=after", "KVBOX_STATE_FILE=" + state}, script); err != nil {
		t.Fatalf("after: %v", err)
	}
	if strings.Contains(p.out.String(), st.Source.Token) {
		t.Errorf("kvbox serve's log holds a sandbox's token")
	}
}
