package main

import (
	"errors"
	"path/filepath"
	"testing"
	"time"

	"kvbox.dev/kvbox/base"
)

func TestParseTTL(t *testing.T) {
	for _, c := range []struct {
		in   string
		want time.Duration
		ok   bool
		bad  bool
	}{
		{"20s", 20 * time.Second, true, false},
		{"1h30m", 90 * time.Minute, true, false},
		{"3d", 72 * time.Hour, true, false},
		{"none", 0, false, false},
		{"None", 0, false, false},
		{"0", 0, false, true},
		{"-5m", 0, false, true},
		{"500ms", 0, false, true},
		{"bogus", 0, false, true},
		{"d", 0, false, true},
		{"1.5d", 0, false, true},
		{"", 0, false, true},
	} {
		d, ok, err := parseTTL(c.in)
		if c.bad {
			if !errors.Is(err, base.ErrInvalid) {
				t.Errorf("parseTTL(%q) = %v, %v, %v; want a usage error", c.in, d, ok, err)
			}
			continue
		}
		if err != nil || d != c.want || ok != c.ok {
			t.Errorf("parseTTL(%q) = %v, %v, %v; want %v, %v", c.in, d, ok, err, c.want, c.ok)
		}
	}
}

func TestTTLLeft(t *testing.T) {
	at := func(d time.Duration) *time.Time { x := time.Now().Add(d); return &x }
	for _, c := range []struct {
		at   *time.Time
		want string
	}{
		{nil, "-"},
		{at(-time.Second), "expired"},
		{at(20*time.Second + 100*time.Millisecond), "20s"},
		{at(5*time.Minute + 3*time.Second + 100*time.Millisecond), "5m03s"},
		{at(2*time.Hour + 7*time.Minute + 100*time.Millisecond), "2h07m"},
		{at(72*time.Hour + time.Minute), "3d"},
	} {
		if got := ttlLeft(c.at); got != c.want {
			t.Errorf("ttlLeft(%v) = %q, want %q", c.at, got, c.want)
		}
	}
}

// A reaper runs in /: the state dir and template it is given must not be
// relative to the working directory of the command that started it.
func TestReaperCommandPathsAbsolute(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	a := &app{uri: "qemu:///system", stateDir: "state", template: "tmpl/box.xml", bridge: "kvbox0", subnet: "172.30.0.0/24"}
	cmd := a.reaperCommand("box", "b1", "uuid")
	if cmd.Dir != "/" {
		t.Errorf("reaper dir %q", cmd.Dir)
	}
	want := map[string]string{"--state-dir": filepath.Join(dir, "state"), "--template": filepath.Join(dir, "tmpl/box.xml")}
	for i, arg := range cmd.Args {
		if w, ok := want[arg]; ok {
			if i+1 >= len(cmd.Args) || cmd.Args[i+1] != w {
				t.Errorf("reaper %s %q, want %q (args %q)", arg, cmd.Args[i+1], w, cmd.Args)
			}
			delete(want, arg)
		}
	}
	if len(want) > 0 {
		t.Errorf("reaper args %q lack %v", cmd.Args, want)
	}
	// absPaths does the same for the command itself (and so for the port
	// holders it starts).
	if err := a.absPaths(); err != nil || a.stateDir != filepath.Join(dir, "state") || a.template != filepath.Join(dir, "tmpl/box.xml") {
		t.Errorf("absPaths: %v, %q %q", err, a.stateDir, a.template)
	}
}
