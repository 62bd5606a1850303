//go:build e2e

package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func storeNames(t testing.TB, sub string) string {
	ents, _ := os.ReadDir(filepath.Join(stateDir, sub))
	var names []string
	for _, e := range ents {
		// Other runs share the state dir: boxes are only this run's.
		if sub != "boxes" || strings.HasPrefix(e.Name(), runID) {
			names = append(names, e.Name())
		}
	}
	return strings.Join(names, " ")
}

// Image names that leave the store and a qcow2 whose data lives in a host
// file are refused by the CLI with one line, and nothing changes: not the
// image store, not the boxes, not the file outside.
func TestIsolationImageInputs(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "host-secret")
	evil := filepath.Join(dir, "evil.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-o", "data_file="+secret, evil, "1M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	// After the create, which makes the data file: the host file kvbox must not touch.
	if err := os.WriteFile(secret, []byte("host secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"images", "rm", "../.."}, `".."`},
		{[]string{"images", "rm", ".."}, `".."`},
		{[]string{"images", "rm", "/etc"}, "may only hold"},
		{[]string{"new", "--image", "../../x", name(t, "x")}, `".."`},
		{[]string{"new", "--image", "../images/tiny", name(t, "x")}, `".."`},
		{[]string{"new", "--image", "a/b", name(t, "x")}, "may only hold"},
		{[]string{"images", "import", "../x", evil}, `".."`},
		{[]string{"images", "import", name(t, "evil"), evil}, "external file " + secret},
	} {
		images, boxes := storeNames(t, "images"), storeNames(t, "boxes")
		r := kvbox(t, tc.args...)
		if r.code == 0 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("kvbox %q: want a failure saying %q, got %s", tc.args, tc.want, r)
		}
		if lines := strings.Count(strings.TrimSpace(r.stderr), "\n") + 1; lines != 1 {
			t.Errorf("kvbox %q: %d lines of error, want 1: %q", tc.args, lines, r.stderr)
		}
		if storeNames(t, "images") != images || storeNames(t, "boxes") != boxes {
			t.Errorf("kvbox %q changed the store", tc.args)
		}
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != "host secret" {
		t.Errorf("the host file behind the data file changed: %d bytes, %v", len(b), err)
	}
}
