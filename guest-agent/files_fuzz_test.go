package agent

import (
	"archive/tar"
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// FuzzExtractFromBox feeds the host's side of kvbox cp any stream a box
// could send and checks its rules hold whatever the bytes: nothing is
// written outside the destination, a failed copy leaves nothing, a copy
// that succeeds is one entry under the host's name holding only
// directories, files and links that stay inside it, with no setuid,
// setgid, sticky, group or world write, within its bound.
func FuzzExtractFromBox(f *testing.F) {
	addHostileStreams(f)
	const limit = 1 << 20
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		dst := filepath.Join(base, "dst")
		if err := os.Mkdir(dst, 0o755); err != nil {
			t.Fatal(err)
		}
		final, err := ExtractFromBox(bytes.NewReader(data), dst, FromBox{Name: "c", MaxBytes: limit})
		if ents, _ := os.ReadDir(base); len(ents) != 1 {
			t.Fatalf("written beside the destination: %v", ents)
		}
		ents, _ := os.ReadDir(dst)
		if err != nil {
			if len(ents) != 0 {
				t.Fatalf("a failed copy (%v) left %v", err, ents)
			}
			return
		}
		if final != filepath.Join(dst, "c") || len(ents) != 1 || ents[0].Name() != "c" {
			t.Fatalf("the copy is %q, the destination holds %v", final, ents)
		}
		checkCopyInside(t, final, limit)
	})
}

// addHostileStreams seeds the fuzzer with a real tree and streams a box
// could craft: setuid and world-writable modes, sparse files, links out
// of the copy and through links, hard links, fifos, names with "..".
func addHostileStreams(f *testing.F) {
	small := filepath.Join(f.TempDir(), "small")
	os.MkdirAll(filepath.Join(small, "sub"), 0o755)
	os.WriteFile(filepath.Join(small, "run.sh"), []byte("#!/bin/sh\n"), 0o4755)
	os.WriteFile(filepath.Join(small, "sub", "f"), []byte("x"), 0o600)
	os.Symlink("../run.sh", filepath.Join(small, "sub", "l"))
	f.Add(tarOf(f, small))
	f.Add(mkStream(f, dirEnt(".ssh/", 0o777), fileEnt(".ssh/authorized_keys", 0o4666, "evil")))
	f.Add(mkStream(f, fileEnt(".bashrc", 0o6777, "evil")))
	f.Add(mkStream(f, paxSparse("f", 512<<10, chunk{0, "head"}, chunk{256 << 10, "mid"})))
	f.Add(mkStream(f, dirEnt("t/", 0o755), gnuSparse("t/f", 2<<20, chunk{0, "x"})))
	f.Add(mkStream(f, dirEnt("t/", 0o755), dirEnt("t/a/", 0o755), linkEnt("t/a/up", "../../x"), linkEnt("t/in", "a"), fileEnt("t/in/f", 0o644, "x")))
	f.Add(mkStream(f, dirEnt("t/", 0o755), linkEnt("t/here", "."), linkEnt("t/trick", "here/../../x")))
	f.Add(mkStream(f, dirEnt("t/", 0o755), ent{h: tar.Header{Name: "t/h", Typeflag: tar.TypeLink, Linkname: "/etc/shadow"}}))
	f.Add(mkStream(f, dirEnt("t/", 0o755), ent{h: tar.Header{Name: "t/p", Typeflag: tar.TypeFifo}}))
	f.Add(mkStream(f, dirEnt("t/", 0o755), fileEnt("t/../x", 0o644, "x"), fileEnt("/t/y", 0o644, "y")))
	f.Add(mkStream(f, linkEnt("l", "/root")))
}

// checkCopyInside walks the copy at final: only directories, files and
// links that stay inside it, no temporary name left, no setuid, setgid,
// sticky, group or world write, and no more than limit written.
func checkCopyInside(t *testing.T, final string, limit int64) {
	var used int64
	err := filepath.WalkDir(final, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if strings.HasPrefix(d.Name(), tmpPrefix) {
			t.Errorf("%s: a temporary name left", p)
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		m := fi.Mode()
		used += entryCost
		switch {
		case m.IsDir():
		case m.IsRegular():
			used += fi.Size()
			if a := fi.Sys().(*syscall.Stat_t).Blocks * 512; a > limit+64<<10 {
				t.Errorf("%s: %d bytes on disk", p, a)
			}
		case m&fs.ModeSymlink != 0:
			if r, err := filepath.EvalSymlinks(p); err == nil && r != final && !strings.HasPrefix(r, final+"/") {
				t.Errorf("%s leads to %s, outside the copy", p, r)
			}
			return nil
		default:
			t.Errorf("%s: a %v", p, m)
		}
		if m&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky|0o022) != 0 {
			t.Errorf("%s: mode %v", p, m)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if used > limit {
		t.Errorf("the copy wrote %d, over its bound of %d", used, limit)
	}
}
