//go:build e2e

package testenv

import (
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// exec --env/--workdir/--user/--timeout on a real guest.
func TestExecOptions(t *testing.T) {
	n := name(t, "execopt")
	newBox(t, n)
	inBox(t, n, "echo 'app:x:1000:1000:app:/home/app:/bin/sh' >> /etc/passwd; echo 'app:x:1000:' >> /etc/group; "+
		"mkdir -p /home/app /srv/app && chown 1000:1000 /home/app /srv/app && chmod 700 /root")

	t.Run("Env", func(t *testing.T) {
		out := mustKvbox(t, "exec", "--env", "CI=1", "-e", "EMPTY=", "--env", "SP=a b", n, "--", "sh", "-c", `echo "$CI|$EMPTY|$SP|$PATH|$HOME"`)
		if want := "1||a b|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin|/root\n"; out != want {
			t.Errorf("--env: got %q, want %q (PATH and HOME kept)", out, want)
		}
		out = mustKvbox(t, "exec", "--env", "PATH=/bin", n, "--", "sh", "-c", `echo "$PATH"`)
		if out != "/bin\n" {
			t.Errorf("--env PATH=/bin: got %q", out)
		}
		if r := kvbox(t, "exec", "--env", "NOEQUALS", n, "--", "true"); r.code != 2 || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("--env without '=': %s", r)
		}
	})
	t.Run("Workdir", func(t *testing.T) {
		if out := mustKvbox(t, "exec", "--workdir", "/srv/app", n, "--", "pwd"); out != "/srv/app\n" {
			t.Errorf("--workdir: pwd = %q", out)
		}
		for dir, want := range map[string]string{
			"/nonexistent": "workdir /nonexistent: no such directory in the box",
			"/etc/passwd":  "workdir /etc/passwd: not a directory",
		} {
			r := kvbox(t, "exec", "--workdir", dir, n, "--", "pwd")
			if r.code != 125 || !strings.Contains(r.stderr, want) || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 || r.stdout != "" {
				t.Errorf("--workdir %s: want exit 125 and one line with %q: %s", dir, want, r)
			}
		}
	})
	t.Run("User", func(t *testing.T) {
		out := mustKvbox(t, "exec", "--user", "app", n, "--", "sh", "-c", `id -u; id -g; echo "$HOME|$USER"; pwd`)
		if want := "1000\n1000\n/home/app|app\n/home/app\n"; out != want {
			t.Errorf("--user app: got %q, want %q", out, want)
		}
		if out := mustKvbox(t, "exec", "--user", "1000", "--workdir", "/srv/app", n, "--", "sh", "-c", "id -u; pwd; touch f; stat -c %u f"); out != "1000\n/srv/app\n1000\n" {
			t.Errorf("--user 1000 --workdir: got %q", out)
		}
		if r := kvbox(t, "exec", "--user", "app", n, "--", "cat", "/root/.profile"); r.code == 0 {
			t.Errorf("app read root's 0700 home: %s", r)
		}
		r := kvbox(t, "exec", "--user", "nosuch", n, "--", "true")
		if r.code != 125 || !strings.Contains(r.stderr, "user nosuch: no such user in the box") || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("--user nosuch: want exit 125, one line: %s", r)
		}
	})
	t.Run("Timeout", func(t *testing.T) {
		// A child in the background and one in the foreground: the
		// whole process group goes.
		start := time.Now()
		r := kvbox(t, "exec", "--timeout", "2s", n, "--", "sh", "-c", "echo $$ > /tmp/to.pid; sleep 300 & echo $! > /tmp/to.child; sleep 300")
		took := time.Since(start)
		if r.code != 124 || !strings.Contains(r.stderr, "timed out after 2s") || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("--timeout 2s: want exit 124 and one line: %s", r)
		}
		if took > 15*time.Second {
			t.Errorf("--timeout 2s took %s", took)
		}
		out := inBox(t, n, `for p in $(cat /tmp/to.pid /tmp/to.child); do if [ -d /proc/$p ]; then echo "alive $p: $(cat /proc/$p/cmdline | tr '\0' ' ')"; fi; done; ps | grep 'sleep 300' | grep -v grep || true`)
		if strings.TrimSpace(out) != "" {
			t.Errorf("after the timeout, still running in the box:\n%s", out)
		}
		// A command that ends in time keeps its own exit code.
		if r := kvbox(t, "exec", "--timeout", "30s", n, "--", "sh", "-c", "exit 3"); r.code != 3 {
			t.Errorf("--timeout 30s of exit 3: %s", r)
		}
	})
}

// kvbox cp of a tree (modes, times, a symlink, a 200 MB file) both ways,
// checksums equal (out of a box without setuid); tar streams with -; one-line refusals; nothing left
// behind by a failed copy.
func TestCopy(t *testing.T) {
	n := name(t, "cp")
	newBox(t, n)
	inBox(t, n, "mkdir /srv")
	dir := t.TempDir()
	src := filepath.Join(dir, "tree")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "bin"), 0o755))
	must(os.MkdirAll(filepath.Join(src, "private"), 0o700))
	must(os.WriteFile(filepath.Join(src, "bin", "run"), []byte("#!/bin/sh\necho ran\n"), 0o755))
	must(os.WriteFile(filepath.Join(src, "private", "key"), []byte("k"), 0o600))
	must(os.WriteFile(filepath.Join(src, "suid"), []byte("s"), 0o644))
	must(os.Chmod(filepath.Join(src, "suid"), os.ModeSetuid|0o751))
	must(os.Symlink("bin/run", filepath.Join(src, "link")))
	big, err := os.Create(filepath.Join(src, "big"))
	must(err)
	_, err = io.CopyN(big, rand.Reader, 200<<20)
	must(err)
	must(big.Close())
	old := time.Date(2021, 5, 6, 7, 8, 9, 0, time.UTC)
	for _, p := range []string{"bin/run", "private/key", "suid", "big", "bin", "private", "."} {
		must(os.Chtimes(filepath.Join(src, p), old, old))
	}
	// What the box must show for the tree: mode, mtime, link target, sum.
	want := map[string]string{
		".":           "755 1620284889",
		"bin":         "755 1620284889",
		"bin/run":     "755 1620284889 " + sha256File(t, filepath.Join(src, "bin/run")),
		"private":     "700 1620284889",
		"private/key": "600 1620284889 " + sha256File(t, filepath.Join(src, "private/key")),
		"suid":        "4751 1620284889 " + sha256File(t, filepath.Join(src, "suid")),
		"big":         "644 1620284889 " + sha256File(t, filepath.Join(src, "big")),
		"link":        "-> bin/run",
	}
	guestView := func(root string) map[string]string {
		t.Helper()
		out := inBox(t, n, `cd `+root+` && for p in . bin bin/run private private/key suid big link; do
			if [ -L "$p" ]; then echo "$p|-> $(readlink $p)"
			elif [ -d "$p" ]; then echo "$p|$(stat -c '%a %Y' $p)"
			else echo "$p|$(stat -c '%a %Y' $p) $(sha256sum < $p | cut -d' ' -f1)"; fi; done`)
		m := map[string]string{}
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			k, v, _ := strings.Cut(l, "|")
			m[k] = v
		}
		return m
	}

	start := time.Now()
	if r := kvbox(t, "cp", src, n+":/srv/"); r.code != 0 || r.stdout != "" || r.stderr != "" {
		t.Fatalf("cp in: %s", r)
	}
	t.Logf("cp in of the tree (200 MB): %s", time.Since(start).Round(time.Millisecond))
	if got := guestView("/srv/tree"); !reflect.DeepEqual(got, want) {
		t.Errorf("in the box:\n got %v\nwant %v", got, want)
	}

	back := filepath.Join(dir, "back")
	start = time.Now()
	if r := kvbox(t, "cp", n+":/srv/tree", back); r.code != 0 || r.stdout != "" || r.stderr != "" {
		t.Fatalf("cp out: %s", r)
	}
	t.Logf("cp out of the tree (200 MB): %s", time.Since(start).Round(time.Millisecond))
	// Out of a box, modes lose setuid (the box is untrusted input).
	for p, w := range want {
		if p == "suid" {
			w = strings.Replace(w, "4751 ", "751 ", 1)
		}
		if got := localView(t, filepath.Join(back, p)); got != w {
			t.Errorf("back on the host, %s: %q, want %q", p, got, w)
		}
	}
	// A single file into a directory and to a new name.
	mustKvbox(t, "cp", n+":/srv/tree/bin/run", dir)
	mustKvbox(t, "cp", filepath.Join(src, "private", "key"), n+":/srv/key2")
	if got := localView(t, filepath.Join(dir, "run")); got != want["bin/run"] {
		t.Errorf("file into a directory: %q", got)
	}
	if got := inBox(t, n, "stat -c '%a %Y' /srv/key2; cat /srv/key2"); got != "600 1620284889\nk" {
		t.Errorf("file to a new name in the box: %q", got)
	}

	t.Run("TarStreams", func(t *testing.T) {
		inBox(t, n, "mkdir -p /srv/fromtar")
		cmd := exec.Command("sh", "-c", "tar -C "+src+" -c bin private | "+kvboxBin+" cp - "+n+":/srv/fromtar")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("tar | kvbox cp -: %v %s", err, out)
		}
		if got := inBox(t, n, "stat -c '%a %Y' /srv/fromtar/bin/run /srv/fromtar/private; cat /srv/fromtar/bin/run"); got != "755 1620284889\n700 1620284889\n#!/bin/sh\necho ran\n" {
			t.Errorf("after tar | kvbox cp -: %q", got)
		}
		out, err := exec.Command("sh", "-c", kvboxBin+" cp "+n+":/srv/tree/bin - | tar -tv").CombinedOutput()
		if err != nil || !strings.Contains(string(out), "bin/run") || !strings.Contains(string(out), "rwxr-xr-x") {
			t.Errorf("kvbox cp BOX:PATH - | tar -tv: %v %s", err, out)
		}
	})

	t.Run("ProgressOnTerminal", func(t *testing.T) {
		// script(1) gives kvbox a terminal: a copy of over a second shows
		// a status line and a summary; without one (every other run
		// here) stderr stays empty. The line is drawn from the start
		// here, so that the check does not hang on how fast the copy is
		// (16 MB took about a second).
		f := filepath.Join(dir, "progress")
		out, err := exec.Command("sh", "-c", "head -c 16777216 "+filepath.Join(src, "big")+" > "+f+" && KVBOX_PROGRESS_AFTER=0s script -qec '"+kvboxBin+" cp "+f+" "+n+":/srv/progress' /dev/null").CombinedOutput()
		if err != nil {
			t.Fatalf("cp on a terminal: %v %s", err, out)
		}
		if s := string(out); !strings.Contains(s, "MB of 16 MB (") || !strings.Contains(s, "/s") || !strings.Contains(s, "copied 16 MB") {
			t.Errorf("cp on a terminal showed no progress: %q", s)
		}
	})

	t.Run("Refusals", func(t *testing.T) {
		file := filepath.Join(dir, "run")
		for _, tc := range []struct {
			args []string
			code int
			msg  string
		}{
			{[]string{"cp", src, name(t, "nosuchbox") + ":/srv"}, 3, "does not exist"},
			{[]string{"cp", n + ":/nope", dir}, 3, "/nope: no such file or directory"},
			{[]string{"cp", src, n + ":/nope/deeper"}, 3, "/nope: no such file or directory"},
			{[]string{"cp", filepath.Join(dir, "missing"), n + ":/srv"}, 3, "missing: no such file or directory"},
			{[]string{"cp", src, n + ":/srv/key2"}, 1, "/srv/key2: not a directory"},
			{[]string{"cp", n + ":/srv/tree", file}, 1, file + ": not a directory"},
			{[]string{"cp", n + ":/srv/tree", filepath.Join(dir, "no", "where")}, 3, "no: no such file or directory"},
			{[]string{"cp", src, dir}, 2, "one of SRC and DST must be BOX:PATH"},
			{[]string{"cp", src, n + ":relative"}, 2, "must be absolute"},
		} {
			r := kvbox(t, tc.args...)
			if r.code != tc.code || !strings.Contains(r.stderr, tc.msg) || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
				t.Errorf("kvbox %s: want exit %d and one line with %q: %s", strings.Join(tc.args, " "), tc.code, tc.msg, r)
			}
		}
		// A copy that fails midway (a 2 MB tmpfs fills up) leaves
		// nothing: no partial file, no temporary name.
		inBox(t, n, "mkdir -p /mnt/small && mount -t tmpfs -o size=2m tmpfs /mnt/small && echo keep > /mnt/small/big")
		r := kvbox(t, "cp", filepath.Join(src, "big"), n+":/mnt/small/big")
		if r.code != 1 || !strings.Contains(r.stderr, "no space left on device") || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("cp of 200 MB into a 2 MB tmpfs: %s", r)
		}
		if out := inBox(t, n, "ls -A /mnt/small; cat /mnt/small/big"); out != "big\nkeep\n" {
			t.Errorf("a failed copy left in /mnt/small (or changed the old file): %q", out)
		}
	})
}

func sha256File(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%x", sha256.Sum256(b))
}

// localView is guestView's line for a path on the host.
func localView(t *testing.T, p string) string {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		return err.Error()
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		l, _ := os.Readlink(p)
		return "-> " + l
	}
	m := fi.Mode()
	perm := uint32(m.Perm())
	if m&os.ModeSetuid != 0 {
		perm |= 0o4000
	}
	s := fmt.Sprintf("%o %d", perm, fi.ModTime().Unix())
	if fi.IsDir() {
		return s
	}
	return s + " " + sha256File(t, p)
}

// After-clone hooks run in name order after the clone is re-identified
// and before its port opens; a failing one fails the clone, which is
// rolled back (no domain, no folder).
func TestAfterCloneHooks(t *testing.T) {
	src, snap := name(t, "hooksrc"), name(t, "hooksnap")
	newBox(t, src)
	// Addresses no box has: an ARP request for one is a frame of the
	// hook's or the test's own, sent at once (a ping would wait in the
	// guest's neighbour queue for the gateway's MAC and leave later).
	whileHooks, afterwards := subnetPrefix+"251", subnetPrefix+"252"
	inBox(t, src, `mkdir -p /etc/kvbox/after-clone.d && cd /etc/kvbox/after-clone.d &&
printf '#!/bin/sh\necho 05 >> /root/order\n' > 05-first &&
printf '#!/bin/sh\necho 10 >> /root/order\narping -c 1 -w 1 -I eth0 `+whileHooks+` >/dev/null 2>&1\necho "$(hostname) $KVBOX_HOOK $(id -u) $(cut -d" " -f19 /proc/$$/stat) $(cat /proc/$$/timerslack_ns)" > /root/hook.log\n' > 10-record &&
printf '#!/bin/sh\ncase "$(hostname)" in *bad*) echo "boom from $(hostname)"; exit 3;; esac\necho 20 >> /root/order\n' > 20-maybe-fail &&
printf '#!/bin/sh\necho never >> /root/order\n' > 30-not-executable &&
chmod 755 05-first 10-record 20-maybe-fail && chmod 644 30-not-executable && sync`)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)

	// Whether the port was open while the hooks ran: hook 10 sends an ARP
	// request for whileHooks. Not one frame of the clone may enter the host
	// before its port opens, neither on the bridge nor on its tap (a tap
	// detached but up hands frames to the host's own IP stack), so the
	// capture is on every interface. Once the clone is up it asks for
	// afterwards the same way, which must show.
	good := name(t, "hookgood")
	stop := capture(t, "-i", "any", "arp")
	r := newClone(t, snap, good)
	if r.code != 0 {
		stop()
		t.Fatalf("clone with passing hooks: %s", r)
	}
	kvbox(t, "exec", good, "--", "arping", "-c", "1", "-w", "1", "-I", "eth0", afterwards)
	lines := strings.Join(stop(), "\n")
	if strings.Contains(lines, "who-has "+whileHooks+" ") {
		t.Errorf("the hook's ARP request entered the host: the port was open while hooks ran:\n%s", lines)
	}
	if !strings.Contains(lines, "who-has "+afterwards+" ") {
		t.Errorf("the clone's own ARP request after it was up was not seen (the capture proves nothing):\n%s", lines)
	}
	// The hooks are asked for as soon as the identity's answer comes,
	// before the agent's boost ends: they must still run at nice 0, and
	// at the kernel's default timer slack (50 µs), not the agent's.
	if got := inBox(t, good, "cat /root/order; cat /root/hook.log"); got != "05\n10\n20\n"+good+" after-clone 0 0 50000\n" {
		t.Errorf("hooks of a good clone recorded %q, want them in order, as root at nice 0 and timer slack 50000 ns, with the new hostname", got)
	}

	bad := name(t, "hookbad")
	r = newClone(t, snap, bad)
	if r.code == 0 || !strings.Contains(r.stderr, "after-clone hook 20-maybe-fail: exit status 3") || !strings.Contains(r.stderr, "boom from "+bad) {
		t.Errorf("clone with a failing hook: want a failure with the hook's output: %s", r)
	}
	t.Logf("clone with a failing hook: %s", strings.TrimSpace(r.stderr))
	if out, err := virsh("dominfo", bad); err == nil {
		t.Errorf("the failed clone's domain is still defined: %s", out)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "boxes", bad)); !os.IsNotExist(err) {
		t.Errorf("the failed clone's folder is still there: %v", err)
	}
	for _, b := range listBoxes(t) {
		if b.Name == bad {
			t.Errorf("kvbox ls lists the failed clone: %+v", b)
		}
	}
}
