//go:build e2e

package testenv

import (
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
