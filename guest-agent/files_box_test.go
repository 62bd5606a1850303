package agent

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"testing/iotest"
	"time"
)

// Crafted streams of a hostile box against the host's side of kvbox cp
// (ExtractFromBox).

type ent struct {
	h    tar.Header
	body string
}

func dirEnt(name string, mode int64) ent {
	return ent{h: tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: mode}}
}
func fileEnt(name string, mode int64, body string) ent {
	return ent{h: tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: mode}, body: body}
}
func linkEnt(name, target string) ent {
	return ent{h: tar.Header{Name: name, Typeflag: tar.TypeSymlink, Linkname: target, Mode: 0o777}}
}

// mkStream writes entries (ent) and raw bytes ([]byte, whole blocks) as
// one tar stream.
func mkStream(t testing.TB, items ...any) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, it := range items {
		switch v := it.(type) {
		case ent:
			h := v.h
			if h.Typeflag == tar.TypeReg {
				h.Size = int64(len(v.body))
			}
			if h.ModTime.IsZero() && h.Typeflag != tar.TypeXGlobalHeader {
				h.ModTime = time.Date(2022, 2, 3, 4, 5, 6, 0, time.UTC)
			}
			if err := tw.WriteHeader(&h); err != nil {
				t.Fatalf("%s: %v", h.Name, err)
			}
			tw.Write([]byte(v.body))
		case []byte:
			tw.Flush()
			b.Write(v)
		default:
			t.Fatalf("mkStream: %T", it)
		}
	}
	tw.Close()
	return b.Bytes()
}

type chunk struct {
	off  int64
	data string
}

// rawHeader is a tar header block; fill sets the fields archive/tar's
// writer would not, before the checksum is taken.
func rawHeader(name string, typ byte, size int64, magic string, fill func(b []byte)) []byte {
	b := make([]byte, 512)
	copy(b[0:100], name)
	tarOctal(b[100:108], 0o644)
	tarOctal(b[108:116], 0)
	tarOctal(b[116:124], 0)
	tarOctal(b[124:136], size)
	tarOctal(b[136:148], 1643861106)
	b[156] = typ
	copy(b[257:265], magic)
	if fill != nil {
		fill(b)
	}
	copy(b[148:156], "        ")
	sum := 0
	for _, c := range b {
		sum += int(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

func tarOctal(f []byte, v int64) { copy(f, fmt.Sprintf("%0*o\x00", len(f)-1, v)) }

func padBlock(b []byte) []byte { return append(b, make([]byte, (512-len(b)%512)%512)...) }

// gnuSparse is an old GNU sparse entry (type 'S', GNU tar's default
// format): a file of realSize bytes of which only the chunks are in the
// stream.
func gnuSparse(name string, realSize int64, chunks ...chunk) []byte {
	var data []byte
	for _, c := range chunks {
		data = append(data, c.data...)
	}
	h := rawHeader(name, 'S', int64(len(data)), "ustar  \x00", func(b []byte) {
		for i, c := range chunks {
			tarOctal(b[386+i*24:398+i*24], c.off)
			tarOctal(b[398+i*24:410+i*24], int64(len(c.data)))
		}
		tarOctal(b[483:495], realSize)
	})
	return append(h, padBlock(data)...)
}

// paxSparse is a PAX sparse entry of format 1.0 (GNU tar --format=posix):
// a regular file (type '0') whose PAX records say it is sparse, its map
// at the start of its data.
func paxSparse(name string, realSize int64, chunks ...chunk) []byte {
	rec := func(k, v string) string {
		s := " " + k + "=" + v + "\n"
		n := len(s) + 1
		for len(strconv.Itoa(n))+len(s) != n {
			n++
		}
		return strconv.Itoa(n) + s
	}
	recs := rec("GNU.sparse.major", "1") + rec("GNU.sparse.minor", "0") + rec("GNU.sparse.name", name) + rec("GNU.sparse.realsize", strconv.FormatInt(realSize, 10))
	m := fmt.Sprintf("%d\n", len(chunks))
	for _, c := range chunks {
		m += fmt.Sprintf("%d\n%d\n", c.off, len(c.data))
	}
	data := padBlock([]byte(m))
	for _, c := range chunks {
		data = append(data, c.data...)
	}
	out := rawHeader("PaxHeaders/"+name, 'x', int64(len(recs)), "ustar\x0000", nil)
	out = append(out, padBlock([]byte(recs))...)
	out = append(out, rawHeader("GNUSparseFile.0/"+name, '0', int64(len(data)), "ustar\x0000", nil)...)
	return append(out, padBlock(data)...)
}

// home is a host directory as a user keeps it: keys, a shell profile, a
// repository with hooks.
func home(t *testing.T) string {
	h := filepath.Join(t.TempDir(), "home")
	for _, d := range []string{"", ".ssh", "repo", "repo/.git", "repo/.git/hooks"} {
		if err := os.Mkdir(filepath.Join(h, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(filepath.Join(h, ".ssh"), 0o700)
	os.WriteFile(filepath.Join(h, ".ssh", "authorized_keys"), []byte("mine"), 0o600)
	os.WriteFile(filepath.Join(h, ".bashrc"), []byte("mine"), 0o644)
	return h
}

// assertHomeIntact checks what home made is as it was and nothing was
// planted beside it but want.
func assertHomeIntact(t *testing.T, h string, want ...string) {
	t.Helper()
	for p, body := range map[string]string{".ssh/authorized_keys": "mine", ".bashrc": "mine"} {
		if b, err := os.ReadFile(filepath.Join(h, p)); err != nil || string(b) != body {
			t.Errorf("%s: %q %v, want %q", p, b, err, body)
		}
	}
	if st, err := os.Stat(filepath.Join(h, ".ssh")); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf(".ssh: %v %v, want mode 0700", st.Mode(), err)
	}
	for _, d := range []string{".ssh", "repo/.git/hooks"} {
		ents, _ := os.ReadDir(filepath.Join(h, d))
		if d == ".ssh" && len(ents) == 1 || d != ".ssh" && len(ents) == 0 {
			continue
		}
		t.Errorf("%s holds %v", d, ents)
	}
	ents, _ := os.ReadDir(h)
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	want = append([]string{".bashrc", ".ssh", "repo"}, want...)
	sort.Strings(want)
	if w := strings.Join(want, " "); strings.Join(got, " ") != w {
		t.Errorf("home holds %v, want %s", got, w)
	}
}

func TestFromBoxHostNamesTheCopy(t *testing.T) {
	// The user asked for /srv/out; the box sends a tree named .ssh.
	h := home(t)
	s := mkStream(t, dirEnt(".ssh/", 0o777), fileEnt(".ssh/authorized_keys", 0o600, "evil"))
	final, err := ExtractFromBox(bytes.NewReader(s), h, FromBox{Name: "out"})
	if err != nil || final != filepath.Join(h, "out") {
		t.Fatalf("ExtractFromBox = %q, %v", final, err)
	}
	if b, _ := os.ReadFile(filepath.Join(h, "out", "authorized_keys")); string(b) != "evil" {
		t.Errorf("out/authorized_keys: %q", b)
	}
	assertHomeIntact(t, h, "out")

	// The user asked for /srv/report.json; the box sends a file named .bashrc.
	h = home(t)
	s = mkStream(t, fileEnt(".bashrc", 0o644, "evil"))
	if final, err := ExtractFromBox(bytes.NewReader(s), h, FromBox{Name: "report.json"}); err != nil || final != filepath.Join(h, "report.json") {
		t.Fatalf("ExtractFromBox = %q, %v", final, err)
	}
	assertHomeIntact(t, h, "report.json")

	// The box sends hooks named .git into the user's repository; the
	// user asked for /srv/notes.
	h = home(t)
	s = mkStream(t, dirEnt(".git/", 0o755), dirEnt(".git/hooks/", 0o755), fileEnt(".git/hooks/post-checkout", 0o755, "evil"))
	if _, err := ExtractFromBox(bytes.NewReader(s), filepath.Join(h, "repo"), FromBox{Name: "notes"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(h, "repo", "notes", "hooks", "post-checkout")); err != nil {
		t.Error(err)
	}
	os.RemoveAll(filepath.Join(h, "repo", "notes"))
	assertHomeIntact(t, h)

	// To a new name, DST is the name whatever the stream says.
	if final, err := ExtractFromBox(bytes.NewReader(mkStream(t, fileEnt(".bashrc", 0o644, "x"))), filepath.Join(h, "new"), FromBox{Name: "ignored"}); err != nil || final != filepath.Join(h, "new") {
		t.Errorf("to a new name: %q %v", final, err)
	}
	assertHomeIntact(t, h, "new")
	assertNoTemp(t, h)
}

func TestFromBoxNeverMerges(t *testing.T) {
	h := home(t)
	for _, tc := range []struct {
		what string
		dst  string
		name string
		s    []byte
		want string
	}{
		{"a tree onto .ssh, the name the user asked for", h, ".ssh",
			mkStream(t, dirEnt(".ssh/", 0o777), fileEnt(".ssh/authorized_keys", 0o644, "evil"), fileEnt(".ssh/rc", 0o755, "evil")),
			filepath.Join(h, ".ssh") + ": exists: a tree from a box is never merged"},
		{"a tree onto a repository", h, "repo",
			mkStream(t, dirEnt("repo/", 0o755), dirEnt("repo/.git/", 0o755), dirEnt("repo/.git/hooks/", 0o755), fileEnt("repo/.git/hooks/pre-commit", 0o755, "evil")),
			"repo: exists: a tree from a box is never merged"},
		{"a tree onto a file", h, ".bashrc", mkStream(t, dirEnt("x/", 0o755), fileEnt("x/y", 0o644, "evil")), ".bashrc: exists"},
		{"a file onto a directory", h, ".ssh", mkStream(t, fileEnt("x", 0o644, "evil")), ".ssh: is a directory (a file cannot replace it)"},
		{"a tree onto DST, an existing directory's own path", filepath.Join(h, ".ssh") + "/.", "x", mkStream(t, dirEnt("x/", 0o755)), ".ssh/x"},
	} {
		_, err := ExtractFromBox(bytes.NewReader(tc.s), tc.dst, FromBox{Name: tc.name})
		if tc.what == "a tree onto DST, an existing directory's own path" {
			// Not a merge: a new tree inside .ssh, named by the host.
			if err != nil {
				t.Errorf("%s: %v", tc.what, err)
			}
			os.Remove(filepath.Join(h, ".ssh", "x"))
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", tc.what, err, tc.want)
		}
	}
	assertHomeIntact(t, h)
	assertNoTemp(t, h)

	// A file replaces a file the user named (cp's rule), with a box's mode.
	s := mkStream(t, fileEnt("whatever", 0o4777, "theirs"))
	if _, err := ExtractFromBox(bytes.NewReader(s), filepath.Join(h, ".bashrc"), FromBox{Name: "x"}); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(filepath.Join(h, ".bashrc")); st.Mode() != 0o755 {
		t.Errorf(".bashrc replaced with mode %v, want 0755", st.Mode())
	}
}

func TestFromBoxModes(t *testing.T) {
	dst := t.TempDir()
	s := mkStream(t,
		dirEnt("m/", 0o1777),
		fileEnt("m/suid", 0o4755, "s"),
		fileEnt("m/sgid", 0o2711, "s"),
		fileEnt("m/all", 0o7777, "s"),
		fileEnt("m/worldw", 0o666, "s"),
		fileEnt("m/groupw", 0o664, "s"),
		fileEnt("m/plain", 0o640, "s"),
		dirEnt("m/sub/", 0o2775),
		dirEnt("m/ro/", 0o555),
		ent{h: tar.Header{Name: "m/owned", Typeflag: tar.TypeReg, Mode: 0o644, Uid: 1000, Gid: 1000, Uname: "app", Gname: "app"}},
	)
	final, err := ExtractFromBox(bytes.NewReader(s), dst, FromBox{Name: "m"})
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]fs.FileMode{
		".": fs.ModeDir | 0o755, "suid": 0o755, "sgid": 0o711, "all": 0o755, "worldw": 0o644,
		"groupw": 0o644, "plain": 0o640, "sub": fs.ModeDir | 0o755, "ro": fs.ModeDir | 0o555, "owned": 0o644,
	} {
		st, err := os.Lstat(filepath.Join(final, p))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode() != want {
			t.Errorf("%s: mode %v, want %v", p, st.Mode(), want)
		}
		if sys := st.Sys().(*syscall.Stat_t); int(sys.Uid) != os.Getuid() || int(sys.Gid) != os.Getgid() {
			t.Errorf("%s: owned by %d:%d, not by who extracted it", p, sys.Uid, sys.Gid)
		}
	}
	// A single file, too.
	if final, err := ExtractFromBox(bytes.NewReader(mkStream(t, fileEnt("f", 0o6777, "x"))), dst, FromBox{Name: "f"}); err != nil {
		t.Fatal(err)
	} else if st, _ := os.Stat(final); st.Mode() != 0o755 {
		t.Errorf("single file: mode %v, want 0755", st.Mode())
	}
	// Into a box the host's modes are kept whole.
	into := t.TempDir()
	if final, err := ExtractTree(bytes.NewReader(s), into); err != nil {
		t.Fatal(err)
	} else if st, _ := os.Stat(filepath.Join(final, "suid")); st.Mode() != fs.ModeSetuid|0o755 {
		t.Errorf("into a box, suid: %v", st.Mode())
	}
}

// allocated is the disk a file takes.
func allocated(t *testing.T, p string) int64 {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Blocks * 512
}

func TestFromBoxSparse(t *testing.T) {
	for _, format := range []struct {
		name   string
		sparse func(string, int64, ...chunk) []byte
	}{{"pax", paxSparse}, {"gnu", gnuSparse}} {
		t.Run(format.name, func(t *testing.T) { testFromBoxSparse(t, format.sparse) })
	}
}

func testFromBoxSparse(t *testing.T, sparse func(string, int64, ...chunk) []byte) {
	dst := t.TempDir()
	const size = 64 << 20
	s := mkStream(t, sparse("f", size, chunk{0, "head"}, chunk{32 << 20, "middle"}, chunk{size - 4, "tail"}))
	final, err := ExtractFromBox(bytes.NewReader(s), dst, FromBox{Name: "f", MaxBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(final)
	if st.Size() != size {
		t.Errorf("size %d, want %d", st.Size(), size)
	}
	if a := allocated(t, final); a > 64<<10 {
		t.Errorf("a sparse entry of 14 bytes of data took %d bytes of disk", a)
	}
	f, _ := os.Open(final)
	defer f.Close()
	for _, c := range []chunk{{0, "head"}, {32 << 20, "middle"}, {size - 4, "tail"}, {1 << 20, "\x00\x00\x00\x00"}} {
		b := make([]byte, len(c.data))
		if _, err := f.ReadAt(b, c.off); err != nil || string(b) != c.data {
			t.Errorf("at %d: %q %v, want %q", c.off, b, err, c.data)
		}
	}

	// The same entry with a bound below what it claims: refused before
	// it is written, nothing left, inside a tree too.
	for _, s := range [][]byte{
		mkStream(t, sparse("f", size, chunk{0, "x"})),
		mkStream(t, dirEnt("t/", 0o755), fileEnt("t/a", 0o644, "a"), sparse("t/bomb", size, chunk{0, "x"})),
	} {
		_, err := ExtractFromBox(bytes.NewReader(s), dst, FromBox{Name: "bomb", MaxBytes: 1 << 20})
		var big *TooBigError
		if !errors.As(err, &big) || big.Limit != 1<<20 {
			t.Errorf("sparse bomb over the bound: %v", err)
		}
		if _, err := os.Lstat(filepath.Join(dst, "bomb")); err == nil {
			t.Error("a refused copy left its name")
		}
	}
	// A plain entry of zeroes is written as holes too.
	s = mkStream(t, fileEnt("z", 0o644, strings.Repeat("\x00", 8<<20)+"end"))
	if final, err := ExtractFromBox(bytes.NewReader(s), dst, FromBox{Name: "z"}); err != nil {
		t.Fatal(err)
	} else if a := allocated(t, final); a > 64<<10 {
		t.Errorf("8 MB of zeroes took %d bytes of disk", a)
	}
	assertNoTemp(t, dst)
}

func TestFromBoxSizeBound(t *testing.T) {
	dst := t.TempDir()
	body := strings.Repeat("x", 400<<10)
	tree := mkStream(t, dirEnt("t/", 0o755), fileEnt("t/a", 0o644, body), fileEnt("t/b", 0o644, body), fileEnt("t/c", 0o644, body))
	_, err := ExtractFromBox(bytes.NewReader(tree), dst, FromBox{Name: "t", MaxBytes: 1 << 20})
	var big *TooBigError
	if !errors.As(err, &big) || big.At != filepath.Join(dst, "t", "c") {
		t.Errorf("three files of 400 KB under 1 MB: %v", err)
	}
	if ents, _ := os.ReadDir(dst); len(ents) != 0 {
		t.Errorf("a refused copy left %v", ents)
	}
	if _, err := ExtractFromBox(bytes.NewReader(tree), dst, FromBox{Name: "t", MaxBytes: 2 << 20}); err != nil {
		t.Errorf("the same under 2 MB: %v", err)
	}
	// Entries count: 3000 empty files are 1.5 MB of what a copy writes.
	items := []any{dirEnt("t/", 0o755)}
	for i := range 3000 {
		items = append(items, fileEnt(fmt.Sprintf("t/%d", i), 0o644, ""))
	}
	if _, err := ExtractFromBox(bytes.NewReader(mkStream(t, items...)), dst, FromBox{Name: "many", MaxBytes: 1 << 20}); !errors.As(err, &big) {
		t.Errorf("3000 empty files under 1 MB: %v", err)
	}
	// The default bound: an entry claiming more is refused at its header
	// (this stream holds no data for it).
	claim := mkStream(t, dirEnt("t/", 0o755))
	hdr := new(bytes.Buffer)
	tw := tar.NewWriter(hdr)
	tw.WriteHeader(&tar.Header{Name: "t/huge", Typeflag: tar.TypeReg, Mode: 0o644, Size: DefaultMaxCopy + 1})
	claim = append(claim[:len(claim)-1024], hdr.Bytes()...)
	_, err = ExtractFromBox(bytes.NewReader(claim), dst, FromBox{Name: "huge"})
	if !errors.As(err, &big) || big.Limit != DefaultMaxCopy {
		t.Errorf("an entry over the default bound: %v", err)
	}
	ents, _ := os.ReadDir(dst)
	if len(ents) != 1 || ents[0].Name() != "t" {
		t.Errorf("refused copies left %v", ents)
	}
}

func TestFromBoxLinks(t *testing.T) {
	dst := t.TempDir()
	var warnings []string
	warn := func(s string) { warnings = append(warnings, s) }
	s := mkStream(t,
		dirEnt("t/", 0o755), dirEnt("t/a/", 0o755), fileEnt("t/a/x", 0o644, "x"),
		linkEnt("t/in", "a/x"),
		linkEnt("t/a/in", "../in"),
		linkEnt("t/a/top", ".."),
		linkEnt("t/here", "."),
		linkEnt("t/abs", "/etc/passwd"),
		linkEnt("t/up", "../outside"),
		linkEnt("t/a/up", "../../x"),
		linkEnt("t/trick", "here/../../x"),
		linkEnt("t/empty", ""),
	)
	final, err := ExtractFromBox(bytes.NewReader(s), dst, FromBox{Name: "t", Warn: warn})
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{"in": "a/x", "a/in": "../in", "a/top": "..", "here": "."} {
		if l, err := os.Readlink(filepath.Join(final, p)); l != want {
			t.Errorf("%s -> %q %v, want %q", p, l, err, want)
		}
	}
	for _, p := range []string{"abs", "up", "a/up", "trick", "empty"} {
		if _, err := os.Lstat(filepath.Join(final, p)); err == nil {
			t.Errorf("%s, a link pointing out, was written", p)
		}
		found := false
		for _, w := range warnings {
			found = found || strings.HasPrefix(w, "skipped "+filepath.Join(final, p)+": a symlink to ")
		}
		if !found {
			t.Errorf("no warning for %s: %q", p, warnings)
		}
	}
	if len(warnings) != 5 {
		t.Errorf("warnings: %q", warnings)
	}
	// Ten are named, the rest counted.
	items := []any{dirEnt("t/", 0o755)}
	for i := range 15 {
		items = append(items, linkEnt(fmt.Sprintf("t/l%d", i), "/x"))
	}
	warnings = nil
	if _, err := ExtractFromBox(bytes.NewReader(mkStream(t, items...)), dst, FromBox{Name: "many", Warn: warn}); err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 11 || warnings[10] != "skipped 5 more symlinks pointing outside the copy" {
		t.Errorf("15 links out: %q", warnings)
	}

	out := t.TempDir()
	for what, s := range map[string][]byte{
		"a copy that is a link out":   mkStream(t, linkEnt("l", "/root/.ssh/authorized_keys")),
		"an entry below a link":       mkStream(t, dirEnt("t/", 0o755), dirEnt("t/a/", 0o755), linkEnt("t/l", "a"), fileEnt("t/l/f", 0o644, "x")),
		"a hard link out":             mkStream(t, dirEnt("t/", 0o755), ent{h: tar.Header{Name: "t/h", Typeflag: tar.TypeLink, Linkname: "/etc/shadow"}}),
		"a hard link in":              mkStream(t, dirEnt("t/", 0o755), fileEnt("t/f", 0o644, "x"), ent{h: tar.Header{Name: "t/h", Typeflag: tar.TypeLink, Linkname: "t/f"}}),
		"a device":                    mkStream(t, dirEnt("t/", 0o755), ent{h: tar.Header{Name: "t/sda", Typeflag: tar.TypeBlock, Devmajor: 8}}),
		"a character device":          mkStream(t, dirEnt("t/", 0o755), ent{h: tar.Header{Name: "t/mem", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 1}}),
		"a fifo":                      mkStream(t, dirEnt("t/", 0o755), ent{h: tar.Header{Name: "t/p", Typeflag: tar.TypeFifo}}),
		"an absolute name":            mkStream(t, dirEnt("t/", 0o755), fileEnt("/t/x", 0o644, "x")),
		"an absolute top":             mkStream(t, dirEnt("/t/", 0o755)),
		"a name climbing out":         mkStream(t, dirEnt("t/", 0o755), fileEnt("t/../x", 0o644, "x")),
		"a name with ..":              mkStream(t, dirEnt("t/", 0o755), dirEnt("t/a/", 0o755), fileEnt("t/a/../b", 0o644, "x")),
		"a name with .":               mkStream(t, dirEnt("t/", 0o755), fileEnt("t/./b", 0o644, "x")),
		"a name outside the top":      mkStream(t, dirEnt("t/", 0o755), fileEnt("u/b", 0o644, "x")),
		"a top that climbs":           mkStream(t, dirEnt("../t/", 0o755)),
		"a global header":             mkStream(t, ent{h: tar.Header{Typeflag: tar.TypeXGlobalHeader, PAXRecords: map[string]string{"comment": "x"}}}),
		"an entry below the top file": mkStream(t, fileEnt("t", 0o644, "x"), fileEnt("t/f", 0o644, "x")),
	} {
		if _, err := ExtractFromBox(bytes.NewReader(s), out, FromBox{Name: "t"}); err == nil {
			t.Errorf("%s: accepted", what)
		}
		if ents, _ := os.ReadDir(out); len(ents) != 0 {
			t.Errorf("%s: left %v", what, ents)
		}
	}
}

// A stream as GNU tar writes it, padded with zeroes to its record size,
// is read to its end; one that goes on after its end is refused; one
// whose reader fails after its end (the box's side failed) leaves nothing.
func TestFromBoxStreamEnd(t *testing.T) {
	dst := t.TempDir()
	s := mkStream(t, dirEnt("t/", 0o755), fileEnt("t/f", 0o644, "x"))
	r := bytes.NewReader(append(append([]byte{}, s...), make([]byte, 10240-len(s)%10240)...))
	if _, err := ExtractFromBox(r, dst, FromBox{Name: "padded"}); err != nil || r.Len() != 0 {
		t.Errorf("a padded stream: %v, %d bytes left unread", err, r.Len())
	}
	long := append(append([]byte{}, s...), make([]byte, maxTrailer+1)...)
	if _, err := ExtractFromBox(bytes.NewReader(long), dst, FromBox{Name: "long"}); err == nil || !strings.Contains(err.Error(), "goes on for more than") {
		t.Errorf("a stream going on after its end: %v", err)
	}
	failing := io.MultiReader(bytes.NewReader(s), iotest.ErrReader(errors.New("the box's side failed")))
	if _, err := ExtractFromBox(failing, dst, FromBox{Name: "failed"}); err == nil || !strings.Contains(err.Error(), "the box's side failed") {
		t.Errorf("a stream whose reader fails after its end: %v", err)
	}
	if got := strings.Join(func() (n []string) {
		ents, _ := os.ReadDir(dst)
		for _, e := range ents {
			n = append(n, e.Name())
		}
		return
	}(), " "); got != "padded" {
		t.Errorf("the destination holds %s, want padded", got)
	}
}
