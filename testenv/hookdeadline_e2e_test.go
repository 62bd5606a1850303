//go:build e2e

package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestAfterCloneHooksDeadline: after-clone hooks that never end fail
// `kvbox new --from` at kvbox's own deadline (--hooks-timeout) and leave
// nothing, as a failing hook does. The snapshot's hook writes to the
// hooks' output every 20 ms and never ends; the guest would kill it at its
// own 30 s per hook, after the host's 20 s deadline. (A background child
// that keeps writing no longer holds a hook open: the agent stops reading
// a process's output at most guestexec.DrainMax after it exits.)
func TestAfterCloneHooksDeadline(t *testing.T) {
	src, snap := name(t, "hangsrc"), name(t, "hangsnap")
	newBox(t, src)
	inBox(t, src, `mkdir -p /etc/kvbox/after-clone.d && cd /etc/kvbox/after-clone.d &&
printf '#!/bin/sh\nmkfifo /tmp/hook-wait\nexec 3<>/tmp/hook-wait\nwhile :; do echo tick; read -t 0.02 x <&3; done\n' > 10-chatty &&
chmod 755 10-chatty && sync`)
	t.Cleanup(func() { kvbox(t, "snapshots", "rm", snap) })
	mustKvbox(t, "snapshots", "new", src, snap)

	cl := name(t, "hangclone")
	t.Cleanup(func() { kvbox(t, "rm", "--force", cl) })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, kvboxBin, "new", "--from", snap, "--hooks-timeout", "20s", cl)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("kvbox new --from with hooks that never end still ran after 5 minutes (killed): %s", out)
	}
	t.Logf("kvbox new --from with hooks that never end: %v: %s", err, out)
	if err == nil || !strings.Contains(string(out), "after-clone hooks did not end within 20s") || !strings.Contains(string(out), "tick") {
		t.Errorf("want a failure at the hooks' deadline with their output: %v: %s", err, out)
	}
	if o, err := virsh("dominfo", cl); err == nil {
		t.Errorf("the failed clone's domain is still defined: %s", o)
	}
	if _, err := os.Stat(filepath.Join(stateDir, "boxes", cl)); !os.IsNotExist(err) {
		t.Errorf("the failed clone's folder is still there: %v", err)
	}
	for _, b := range listBoxes(t) {
		if b.Name == cl {
			t.Errorf("kvbox ls lists the failed clone: %+v", b)
		}
	}
}
