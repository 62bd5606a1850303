package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spf13/cobra/doc"
)

// docsDir is the generated command reference, beside the hand-written guides.
const docsDir = "../../docs/reference"

// genDocs writes the markdown and man reference of every command into dir,
// with the defaults a host without KVBOX_* or LIBVIRT_DEFAULT_URI set sees.
func genDocs(t *testing.T, dir string) {
	for _, k := range []string{"LIBVIRT_DEFAULT_URI", "KVBOX_STATE_DIR", "KVBOX_BRIDGE", "KVBOX_SUBNET", "KVBOX_TEMPLATE", "KVBOX_DOMAIN_TYPE", "KVBOX_CP_MAX_SIZE"} {
		t.Setenv(k, "")
	}
	root := (&app{}).newRoot()
	root.DisableAutoGenTag = true
	root.InitDefaultCompletionCmd()
	root.InitDefaultHelpCmd()
	for _, d := range []string{"markdown", "man"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := doc.GenMarkdownTree(root, filepath.Join(dir, "markdown")); err != nil {
		t.Fatal(err)
	}
	epoch := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC) // fixed: the pages do not change by the day
	hdr := &doc.GenManHeader{Title: "KVBOX", Section: "1", Source: "kvbox", Manual: "kvbox manual", Date: &epoch}
	if err := doc.GenManTree(root, hdr, filepath.Join(dir, "man")); err != nil {
		t.Fatal(err)
	}
}

// The command reference in docs/reference is what the commands say about
// themselves. `make docs` regenerates it (KVBOX_UPDATE_DOCS=1).
func TestDocsMatchCommands(t *testing.T) {
	if os.Getenv("KVBOX_UPDATE_DOCS") == "1" {
		os.RemoveAll(docsDir)
		genDocs(t, docsDir)
		return
	}
	tmp := t.TempDir()
	genDocs(t, tmp)
	for _, d := range []string{"markdown", "man"} {
		want, _ := filepath.Glob(filepath.Join(tmp, d, "*"))
		have, _ := filepath.Glob(filepath.Join(docsDir, d, "*"))
		if len(want) != len(have) {
			t.Errorf("docs/reference/%s has %d files, the commands make %d: run make docs", d, len(have), len(want))
		}
		for _, w := range want {
			got, err := os.ReadFile(filepath.Join(docsDir, d, filepath.Base(w)))
			exp, _ := os.ReadFile(w)
			if err != nil || !bytes.Equal(got, exp) {
				t.Errorf("docs/reference/%s/%s does not match the commands: run make docs", d, filepath.Base(w))
			}
		}
	}
}
