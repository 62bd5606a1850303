package snapshot

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kvbox.dev/kvbox/domain"
)

// A snapshot's RAM copy and its seal run as root in folders QEMU's user
// can write (the box folder, the partial snapshot folder): a link planted
// there is refused, and the host file it points to is neither read into
// the snapshot nor written, truncated or chmodded.
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
	copyMemory := func(boxDir, tmp string) error {
		c := &creation{box: domain.Box{Name: "b", Meta: domain.Meta{Dir: boxDir}}, tmp: tmp}
		return c.copyMemory(context.Background())
	}

	// The box's RAM file is a link: nothing of the host file is copied.
	boxDir, tmp := t.TempDir(), t.TempDir()
	os.Symlink(secret, domain.MemoryFile(boxDir))
	if err := copyMemory(boxDir, tmp); err == nil {
		t.Error("the RAM copy read through a link in the box folder")
	}
	if b, _ := os.ReadFile(filepath.Join(tmp, MemoryFile)); strings.Contains(string(b), "secret") {
		t.Error("the host file is in the snapshot")
	}

	// The copy's own name is planted in the partial folder.
	boxDir, tmp = t.TempDir(), t.TempDir()
	os.WriteFile(domain.MemoryFile(boxDir), []byte("guest ram"), 0o600)
	os.Symlink(secret, filepath.Join(tmp, MemoryFile))
	if err := copyMemory(boxDir, tmp); err == nil {
		t.Error("the RAM copy wrote through a link in the partial folder")
	}
	untouched()

	// The real thing copies.
	boxDir, tmp = t.TempDir(), t.TempDir()
	os.WriteFile(domain.MemoryFile(boxDir), []byte("guest ram"), 0o600)
	if err := copyMemory(boxDir, tmp); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(tmp, MemoryFile)); string(b) != "guest ram" {
		t.Errorf("copy: %q", b)
	}

	// seal syncs and chmods every file of the folder: a link is refused.
	dir := t.TempDir()
	os.Symlink(secret, filepath.Join(dir, domain.AgentTokenFile))
	if err := seal(&domain.Host{}, dir, Snapshot{Name: "s"}); err == nil {
		t.Error("seal went through a link in the partial folder")
	}
	untouched()
}
