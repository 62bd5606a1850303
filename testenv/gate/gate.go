// Package gate is the one place tests decide whether this host can run them:
// root, tools, a libvirtd, the tiny guest image, vsock. A test calls the gate
// for what it needs; without it the test is skipped with the reason, or,
// under KVBOX_TEST_STRICT=1 (make test sets it, so CI does), fails: where
// the suite is meant to run whole nothing is skipped silently. Vsock is the
// exception: hosts without vhost-vsock (this test machine) skip its tests in
// every mode, saying so.
package gate

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// StrictEnv names the variable that turns a missing requirement into a
// failure.
const StrictEnv = "KVBOX_TEST_STRICT"

// Strict reports whether missing requirements fail tests.
func Strict() bool { return os.Getenv(StrictEnv) == "1" }

// lacks skips t, or fails it under Strict, because the host lacks what.
func lacks(t testing.TB, format string, args ...any) {
	t.Helper()
	if Strict() {
		t.Fatalf("this host lacks what the test needs ("+StrictEnv+"=1): "+format, args...)
	}
	t.Skipf("skipped: "+format, args...)
}

// Root needs the test to run as root.
func Root(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		lacks(t, "needs root")
	}
}

// Tools needs every named program on PATH.
func Tools(t testing.TB, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			lacks(t, "needs %s on PATH", n)
		}
	}
}

// Long skips a test that boots a machine when go test runs with -short;
// that is the caller's choice, so it skips in every mode.
func Long(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("skipped with -short: boots a machine")
	}
}

// File needs path to exist (a device, a mount).
func File(t testing.TB, path, what string) {
	t.Helper()
	if _, err := os.Stat(path); err != nil {
		lacks(t, "needs %s (%s): %v", what, path, err)
	}
}

// LibvirtSocket needs a libvirtd answering on qemu:///system's socket
// (testenv/setup.sh starts one).
func LibvirtSocket(t testing.TB) {
	t.Helper()
	File(t, "/var/run/libvirt/libvirt-sock", "a running libvirtd (bash testenv/setup.sh)")
}

// Vsock needs vhost-vsock on the host. Hosts without it skip in every mode.
func Vsock(t testing.TB) {
	t.Helper()
	if _, err := os.Stat("/dev/vhost-vsock"); err != nil {
		t.Skip("skipped: this host has no /dev/vhost-vsock; the agent's vsock transport is tested where it has")
	}
}

// TinyImage returns the folder testenv/tiny/build.sh built the tiny guest
// into: $KVBOX_AGENT_IMAGE, else the set-up's cache
// ($KVBOX_TESTENV_CACHE or /var/cache/kvbox-testenv, then images/tiny).
func TinyImage(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("KVBOX_AGENT_IMAGE")
	if dir == "" {
		cache := os.Getenv("KVBOX_TESTENV_CACHE")
		if cache == "" {
			cache = "/var/cache/kvbox-testenv"
		}
		dir = filepath.Join(cache, "images", "tiny")
	}
	for _, f := range []string{"disk.qcow2", "vmlinuz", "initrd.img", "cmdline"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			lacks(t, "needs the tiny image in %s (bash testenv/setup.sh builds it): %v", dir, err)
		}
	}
	return dir
}
