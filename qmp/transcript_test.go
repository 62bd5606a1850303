package qmp

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestTranscriptRecordsCommandsAndPollTransitions(t *testing.T) {
	status, polls := "active", 0
	c := New(runFunc(func(b []byte) ([]byte, error) {
		if strings.Contains(string(b), "query-migrate") {
			polls++ // a live copy's counters change at every poll
			return []byte(fmt.Sprintf(`{"return":{"status":"%s","ram":{"transferred":%d}}}`, status, polls)), nil
		}
		return []byte(`{"error":{"class":"GenericError","desc":"no"}}`), nil
	}))
	path := filepath.Join(t.TempDir(), "box.qmp.log")
	c.Transcript = &Transcript{Path: path, MaxBytes: 1 << 20}
	ctx := context.Background()
	for range 50 {
		c.QueryMigrate(ctx)
	}
	status = "completed"
	c.QueryMigrate(ctx)
	c.QueryMigrate(ctx)
	c.Execute(ctx, "blockdev-del", map[string]any{"node-name": "x"}, nil)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	log := string(b)
	if n := strings.Count(log, `-> {"execute":"query-migrate"}`); n != 2 {
		t.Errorf("query-migrate recorded %d times, want 2 (its two replies)\n%s", n, log)
	}
	if !strings.Contains(log, `-> {"execute":"blockdev-del","arguments":{"node-name":"x"}}`) || !strings.Contains(log, `"desc":"no"`) {
		t.Errorf("the failed command or its reply is missing:\n%s", log)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Errorf("transcript mode %v, want 0600", fi.Mode().Perm())
	}
}

func TestTranscriptRotatesAndRefusesLinks(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "box.qmp.log")
	c := New(runFunc(func([]byte) ([]byte, error) { return []byte(`{"return":{}}`), nil }))
	c.Transcript = &Transcript{Path: path, MaxBytes: 200}
	for range 10 {
		c.Execute(context.Background(), "cont", nil, nil)
	}
	if _, err := os.Stat(path + ".1"); err != nil {
		t.Errorf("no rotated file: %v", err)
	}
	if fi, _ := os.Stat(path); fi.Size() > 400 {
		t.Errorf("transcript grew to %d bytes past its limit", fi.Size())
	}
	target := filepath.Join(dir, "target")
	os.WriteFile(target, nil, 0o600)
	link := filepath.Join(dir, "link.qmp.log")
	os.Symlink(target, link)
	c.Transcript = &Transcript{Path: link}
	c.Execute(context.Background(), "cont", nil, nil)
	if b, _ := os.ReadFile(target); len(b) != 0 {
		t.Errorf("the transcript followed a link: %q", b)
	}
}
