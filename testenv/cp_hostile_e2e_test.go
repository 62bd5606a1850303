//go:build e2e

package testenv

import (
	"archive/tar"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
)

// kvbox cp out of a hostile box on a real guest: the box's own agent sends
// a tree with setuid, setgid, sticky and world-writable entries; then the
// box's root replaces the file helper kvbox cp runs (the agent's binary,
// which the agent runs by its path) with a script that answers chosen
// paths with crafted streams: a tree or a file under another name than the
// one the user asked for, sparse entries (GNU tar's two formats) and a
// sparse bomb. The host names the copy, never merges it into what exists,
// drops the modes' special and write bits, writes holes as holes and
// bounds what a copy writes (--max-size, KVBOX_CP_MAX_SIZE).
func TestCopyFromHostileBox(t *testing.T) {
	n := name(t, "cphostile")
	newBox(t, n)
	dir := t.TempDir()

	t.Run("Modes", func(t *testing.T) {
		inBox(t, n, "mkdir -p /srv/m/sub && echo s > /srv/m/suid && echo g > /srv/m/sgid && echo w > /srv/m/ww && echo v > /srv/m/gw && "+
			"chmod 4755 /srv/m/suid && chmod 2711 /srv/m/sgid && chmod 666 /srv/m/ww && chmod 664 /srv/m/gw && chmod 2777 /srv/m/sub && chmod 1777 /srv/m")
		if r := kvbox(t, "cp", n+":/srv/m", dir); r.code != 0 || r.stderr != "" {
			t.Fatalf("cp of /srv/m: %s", r)
		}
		for p, want := range map[string]string{".": "755", "suid": "755", "sgid": "711", "ww": "644", "gw": "644", "sub": "755"} {
			if got := modeOwner(t, filepath.Join(dir, "m", p)); got != want+" 0:0" {
				t.Errorf("m/%s: %s, want %s 0:0", p, got, want)
			}
		}
		mustKvbox(t, "cp", n+":/srv/m/suid", filepath.Join(dir, "one"))
		if got := modeOwner(t, filepath.Join(dir, "one")); got != "755 0:0" {
			t.Errorf("a setuid file copied alone: %s", got)
		}
	})

	// The streams the hostile box sends, by the path asked for.
	hostile := filepath.Join(dir, "hostile")
	for _, d := range []string{"srv", "root"} {
		if err := os.MkdirAll(filepath.Join(hostile, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeTar(t, filepath.Join(hostile, "srv", "out.tar"), // asked: /srv/out
		&tar.Header{Name: ".ssh/", Typeflag: tar.TypeDir, Mode: 0o777},
		&tar.Header{Name: ".ssh/authorized_keys", Typeflag: tar.TypeReg, Mode: 0o644, Size: 4})
	writeTar(t, filepath.Join(hostile, "srv", "report.json.tar"), // asked: /srv/report.json
		&tar.Header{Name: ".bashrc", Typeflag: tar.TypeReg, Mode: 0o4755, Size: 4})
	writeTar(t, filepath.Join(hostile, "root", ".ssh.tar"), // asked: /root/.ssh
		&tar.Header{Name: ".ssh/", Typeflag: tar.TypeDir, Mode: 0o700},
		&tar.Header{Name: ".ssh/rc", Typeflag: tar.TypeReg, Mode: 0o755, Size: 4})
	// Sparse streams as GNU tar writes them: 1 GiB with 4 bytes of data
	// in its middle, in PAX (1.0) and GNU formats; a bomb of 2 GiB of
	// holes.
	sparse := filepath.Join(dir, "sparse-src")
	os.Mkdir(sparse, 0o755)
	makeSparse(t, filepath.Join(sparse, "f"), 1<<30, 512<<20, "data")
	makeSparse(t, filepath.Join(sparse, "bomb"), 2<<30, -1, "")
	gnuTar(t, sparse, "f", filepath.Join(hostile, "srv", "sparse.tar"), "--format=posix")
	gnuTar(t, sparse, "f", filepath.Join(hostile, "srv", "sparse-gnu.tar"), "--format=gnu")
	gnuTar(t, sparse, "bomb", filepath.Join(hostile, "srv", "bomb.tar"), "--format=posix")
	mustKvbox(t, "cp", hostile, n+":/")
	inBox(t, n, `cp /usr/local/bin/kvbox-agent /root/agent.real && cat > /root/helper <<'EOF'
#!/bin/sh
if [ "$1" = files-helper ] && [ "$2" = send ] && [ -f "/hostile$3.tar" ]; then
	echo "total 0" >&2
	exec cat "/hostile$3.tar"
fi
exec /root/agent.real "$@"
EOF
chmod 755 /root/helper && mv /root/helper /usr/local/bin/kvbox-agent`)

	t.Run("Names", func(t *testing.T) {
		home := filepath.Join(dir, "home")
		os.MkdirAll(filepath.Join(home, ".ssh"), 0o700)
		os.WriteFile(filepath.Join(home, ".ssh", "authorized_keys"), []byte("mine"), 0o600)
		os.WriteFile(filepath.Join(home, ".bashrc"), []byte("mine"), 0o644)
		intact := func(want ...string) {
			t.Helper()
			for p, body := range map[string]string{".ssh/authorized_keys": "mine", ".bashrc": "mine"} {
				if b, err := os.ReadFile(filepath.Join(home, p)); string(b) != body {
					t.Errorf("%s: %q %v, want %q", p, b, err, body)
				}
			}
			if got := ls(t, filepath.Join(home, ".ssh")); got != "authorized_keys" {
				t.Errorf(".ssh holds %s", got)
			}
			if got := modeOwner(t, filepath.Join(home, ".ssh")); got != "700 0:0" {
				t.Errorf(".ssh: %s", got)
			}
			want = append(want, ".bashrc", ".ssh")
			sort.Strings(want)
			if got := ls(t, home); got != strings.Join(want, " ") {
				t.Errorf("home holds %s, want %s", got, strings.Join(want, " "))
			}
		}
		// Asked /srv/out, sent a tree named .ssh.
		if r := kvbox(t, "cp", n+":/srv/out", home); r.code != 0 || r.stderr != "" {
			t.Errorf("cp of /srv/out: %s", r)
		}
		if b, _ := os.ReadFile(filepath.Join(home, "out", "authorized_keys")); string(b) != "evil" {
			t.Errorf("out/authorized_keys: %q", b)
		}
		intact("out")
		// Asked /srv/report.json, sent a setuid file named .bashrc.
		if r := kvbox(t, "cp", n+":/srv/report.json", home); r.code != 0 || r.stderr != "" {
			t.Errorf("cp of /srv/report.json: %s", r)
		}
		if got := modeOwner(t, filepath.Join(home, "report.json")); got != "755 0:0" {
			t.Errorf("report.json: %s", got)
		}
		intact("out", "report.json")
		// Asked /root/.ssh, which the host has: refused, not merged.
		r := kvbox(t, "cp", n+":/root/.ssh", home)
		if r.code != 1 || !strings.Contains(r.stderr, filepath.Join(home, ".ssh")+": exists: a tree from a box is never merged") || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("cp of /root/.ssh onto the host's .ssh: %s", r)
		}
		intact("out", "report.json")
	})

	t.Run("Sparse", func(t *testing.T) {
		for _, p := range []string{"sparse", "sparse-gnu"} {
			if r := kvbox(t, "cp", n+":/srv/"+p, dir); r.code != 0 || r.stderr != "" {
				t.Errorf("cp of /srv/%s: %s", p, r)
				continue
			}
			f := filepath.Join(dir, p)
			st, err := os.Stat(f)
			if err != nil {
				t.Fatal(err)
			}
			if used := st.Sys().(*syscall.Stat_t).Blocks * 512; st.Size() != 1<<30 || used > 1<<20 {
				t.Errorf("%s: %d bytes taking %d on disk, want 1 GiB in holes", p, st.Size(), used)
			}
			b := make([]byte, 4)
			fh, _ := os.Open(f)
			fh.ReadAt(b, 512<<20)
			fh.Close()
			if string(b) != "data" {
				t.Errorf("%s: %q at 512 MiB", p, b)
			}
		}
	})

	t.Run("Bound", func(t *testing.T) {
		out := filepath.Join(dir, "bound")
		os.Mkdir(out, 0o755)
		refused := func(what string, r result, at string) {
			t.Helper()
			want := "the copy would write more than --max-size 1 GB on the host (at " + at + "); nothing was written"
			if r.code != 1 || !strings.Contains(r.stderr, want) || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
				t.Errorf("%s: want exit 1 and one line with %q: %s", what, want, r)
			}
			if got := ls(t, out); got != "" {
				t.Errorf("%s left %s", what, got)
			}
		}
		// The box lies about the total (0): the bomb's entry is refused.
		refused("the bomb with --max-size 1G", kvbox(t, "cp", "--max-size", "1G", n+":/srv/bomb", out), filepath.Join(out, "bomb"))
		t.Setenv("KVBOX_CP_MAX_SIZE", "1G")
		refused("the bomb with KVBOX_CP_MAX_SIZE=1G", kvbox(t, "cp", n+":/srv/bomb", out), filepath.Join(out, "bomb"))
		// The box's real agent says first what it will send: refused
		// before a byte is written.
		inBox(t, n, "dd if=/dev/zero of=/srv/big bs=1M seek=2048 count=0 2>/dev/null")
		refused("a 2 GiB file with KVBOX_CP_MAX_SIZE=1G", kvbox(t, "cp", n+":/srv/big", out), "/srv/big in the box")
	})
}

// modeOwner is "MODE UID:GID" of p, the mode in octal with its special
// bits.
func modeOwner(t *testing.T, p string) string {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Lstat(p, &st); err != nil {
		return err.Error()
	}
	return fmt.Sprintf("%o %d:%d", st.Mode&0o7777, st.Uid, st.Gid)
}

// ls is the names in dir, sorted, space-separated.
func ls(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err.Error()
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return strings.Join(names, " ")
}

// writeTar writes a stream of headers; a file's content is "evil".
func writeTar(t *testing.T, p string, hs ...*tar.Header) {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, h := range hs {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			tw.Write([]byte("evil")[:h.Size])
		}
	}
	tw.Close()
	if err := os.WriteFile(p, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// makeSparse makes a file of size bytes, all hole but data at off.
func makeSparse(t *testing.T, p string, size, off int64, data string) {
	t.Helper()
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	if off >= 0 {
		if _, err := f.WriteAt([]byte(data), off); err != nil {
			t.Fatal(err)
		}
	}
}

// gnuTar archives dir/name with GNU tar's --sparse into out.
func gnuTar(t *testing.T, dir, name, out string, format string) {
	t.Helper()
	if b, err := exec.Command("tar", "--sparse", format, "-C", dir, "-cf", out, name).CombinedOutput(); err != nil {
		t.Fatalf("tar %s: %v %s", format, err, b)
	}
}
