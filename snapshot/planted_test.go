package snapshot

import (
	"os"
	"path/filepath"
	"testing"

	"kvbox.dev/kvbox/domain"
)

// A snapshot's seal runs as root in a folder QEMU's user can write (the
// partial snapshot folder): a link planted there is refused, and the host
// file it points to is neither written, truncated nor chmodded.
func TestSnapshotRefusesPlantedLinks(t *testing.T) {
	secret := filepath.Join(t.TempDir(), "shadow")
	if err := os.WriteFile(secret, []byte("root:secret"), 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(secret, 0o644)
	untouched := func() {
		t.Helper()
		b, err := os.ReadFile(secret)
		fi, _ := os.Stat(secret)
		if err != nil || string(b) != "root:secret" || fi.Mode().Perm() != 0o644 {
			t.Fatalf("the host file was changed through a planted link: %q %v %v", b, fi.Mode(), err)
		}
	}
	// seal syncs and chmods every file of the folder: a link is refused.
	dir := t.TempDir()
	os.Symlink(secret, filepath.Join(dir, domain.AgentTokenFile))
	if err := seal(&domain.Host{}, dir, Snapshot{Name: "s"}); err == nil {
		t.Error("seal went through a link in the partial folder")
	}
	untouched()
}
