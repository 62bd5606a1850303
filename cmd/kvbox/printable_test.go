package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/terminal"
)

// Strings a guest, a hook or a pulled artifact can choose.
var hostile = []struct{ in, want string }{
	{"plain name.txt", "plain name.txt"},
	{"lines\nand\ttabs", "lines\nand\ttabs"},
	{"été 日本 ✓ 🎉 a\u00a0b", "été 日本 ✓ 🎉 a\u00a0b"},
	{"\x1b]0;owned\x07title", `\u001b]0;owned\u0007title`},
	{"\x1b[2J\x1b[1;1Hclear", `\u001b[2J\u001b[1;1Hclear`},
	{"c1 csi \u009b31m", `c1 csi \u009b31m`},
	{"over\rwrite", `over\u000dwrite`},
	{"del\x7f", `del\u007f`},
	{"evil\u202egnp.exe", `evil\u202egnp.exe`},
	{"iso\u2066late\u2069", `iso\u2066late\u2069`},
	{"zero\u200bwidth", `zero\u200bwidth`},
	{"line\u2028sep", `line\u2028sep`},
	{"tag\U000e0041", `tag\udb40\udc41`},
	{"bad \xff\xfe utf8 \xe2\x82", `bad \xff\xfe utf8 \xe2\x82`},
	{"real \ufffd stays", "real \ufffd stays"},
}

func TestPrintable(t *testing.T) {
	for _, c := range hostile {
		got := terminal.Printable(c.in)
		if got != c.want {
			t.Errorf("terminal.Printable(%q) = %q, want %q", c.in, got, c.want)
		}
		for _, r := range got {
			if r != '\n' && r != '\t' && !unicode.IsGraphic(r) {
				t.Errorf("terminal.Printable(%q) keeps %U", c.in, r)
			}
		}
		if !utf8.ValidString(got) {
			t.Errorf("terminal.Printable(%q) is not UTF-8: %q", c.in, got)
		}
	}
}

// The CLI's edge: a pulled snapshot's fields reach the terminal printable
// in kvbox's own listing, and exact in --json, which stays JSON a program
// decodes back to the very same strings. kvbox runs on libvirt's test
// driver (in-process, nothing of the machine touched) with a state dir of
// the test's own.
func TestCLIOutputPrintable(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("kvbox runs as root")
	}
	state := t.TempDir()
	var boxes []string
	for i, c := range hostile {
		name := "pulled" + string(rune('a'+i))
		dir := filepath.Join(state, "snapshots", name)
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(snapshot.Snapshot{Name: name, Box: c.in, Image: c.in})
		if err := os.WriteFile(filepath.Join(dir, snapshot.MetaFile), b, 0o640); err != nil {
			t.Fatal(err)
		}
		boxes = append(boxes, c.in)
	}
	kv := func(args ...string) string {
		t.Helper()
		var out, errb bytes.Buffer
		code := run(context.Background(), append([]string{"--connect", "test:///default", "--state-dir", state}, args...), IO{In: strings.NewReader(""), Out: &out, Err: &errb})
		if code != 0 {
			t.Fatalf("kvbox %v: exit %d: %s", args, code, errb.String())
		}
		for _, s := range []string{out.String(), errb.String()} {
			for i, r := range s {
				if (r == utf8.RuneError && !strings.HasPrefix(s[i:], "\ufffd")) || (r != '\n' && r != '\t' && !unicode.IsGraphic(r)) {
					t.Fatalf("kvbox %v printed %U at %d: %q", args, r, i, s)
				}
			}
		}
		return out.String()
	}
	// What kvbox reads from snapshot.json: encoding/json has made any
	// invalid UTF-8 U+FFFD already.
	read := func(s string) string {
		var out string
		b, _ := json.Marshal(s)
		json.Unmarshal(b, &out)
		return out
	}
	table := kv("snapshots", "ls")
	lines := strings.Split(strings.TrimSuffix(table, "\n"), "\n")
	if len(lines) != len(hostile)+1 {
		t.Errorf("snapshots ls has %d lines for %d snapshots (a field started a row of its own):\n%s", len(lines), len(hostile), table)
	}
	for _, c := range hostile {
		if cell := terminal.Line(read(c.in)); !strings.Contains(table, cell) {
			t.Errorf("snapshots ls does not show %q as %q:\n%s", c.in, cell, table)
		}
	}
	var rows []kvbox.SnapshotInfo
	if err := json.Unmarshal([]byte(kv("snapshots", "ls", "--json")), &rows); err != nil {
		t.Fatalf("snapshots ls --json is not JSON: %v", err)
	}
	if len(rows) != len(hostile) {
		t.Fatalf("%d rows", len(rows))
	}
	for _, r := range rows {
		i := int(r.Name[len("pulled")] - 'a')
		if want := read(boxes[i]); r.Box != want {
			t.Errorf("snapshots ls --json gives box %q, want %q exactly", r.Box, want)
		}
	}
}
