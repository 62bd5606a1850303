//go:build e2e

package testenv

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// versions lists the version folders of image img.
func versions(t testing.TB, img string) []string {
	t.Helper()
	ents, _ := os.ReadDir(filepath.Join(stateDir, "images", img))
	var vs []string
	for _, e := range ents {
		if e.IsDir() && strings.HasPrefix(e.Name(), "v-") {
			vs = append(vs, e.Name())
		}
	}
	return vs
}

// An image a box or a snapshot builds on cannot be removed (exit 5, the
// user named), and `images import --replace` keeps the versions in use and
// prunes the others; once nothing uses it, `images rm` removes every version.
func TestImagesRmAndReplace(t *testing.T) {
	var tiny struct{ Disk, Kernel, Initrd, Cmdline string }
	b, err := os.ReadFile(filepath.Join(stateDir, "images", "tiny", "image.json"))
	if err != nil || json.Unmarshal(b, &tiny) != nil {
		t.Fatalf("read the tiny image: %v", err)
	}
	img, n, snap := name(t, "img"), name(t, "imgbox"), name(t, "imgsnap")
	imp := func(extra ...string) {
		t.Helper()
		mustKvbox(t, append([]string{"images", "import", img, tiny.Disk, "--kernel", tiny.Kernel, "--initrd", tiny.Initrd,
			"--cmdline", tiny.Cmdline, "--agent", "yes"}, extra...)...)
	}
	t.Cleanup(func() {
		kvbox(t, "rm", "--force", n)
		kvbox(t, "snapshots", "rm", snap)
		kvbox(t, "images", "rm", img)
	})
	imp()
	newBox(t, n, "--image", img)
	refused := func(user string) {
		t.Helper()
		r := kvbox(t, "images", "rm", img)
		if r.code != 5 || !strings.Contains(r.stderr, user) || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Errorf("images rm of an image %s builds on: want exit 5 and one line naming it, got %s", user, r)
		}
		if len(versions(t, img)) == 0 {
			t.Fatalf("images rm removed an image %s builds on", user)
		}
	}
	refused("box " + n)
	mustKvbox(t, "snapshots", "new", n, snap)
	mustKvbox(t, "rm", "--force", n)
	refused("snapshot " + snap)

	// A new version while a snapshot or a box builds on the first: both
	// stay, until the last user of the old one goes.
	for _, user := range []string{"snapshot", "box"} {
		rm := []string{"snapshots", "rm", snap}
		if user == "box" {
			newBox(t, n, "--image", img)
			rm = []string{"rm", "--force", n}
		}
		imp("--replace")
		if vs := versions(t, img); len(vs) != 2 {
			t.Fatalf("after import --replace with a %s on the old version: versions %v, want 2", user, vs)
		}
		mustKvbox(t, rm...)
		if vs := versions(t, img); len(vs) != 1 {
			t.Errorf("after the last %s on the old version went: versions %v, want only the new one", user, vs)
		}
	}
	imp("--replace")
	vs := versions(t, img)
	if len(vs) != 1 {
		t.Fatalf("after import --replace with nothing using the old versions: versions %v, want only the new one", vs)
	}
	var now struct{ Disk string }
	b, _ = os.ReadFile(filepath.Join(stateDir, "images", img, "image.json"))
	if json.Unmarshal(b, &now) != nil || filepath.Base(filepath.Dir(now.Disk)) != vs[0] {
		t.Errorf("the version kept (%s) is not the image's current one (%s)", vs[0], now.Disk)
	}
	mustKvbox(t, "images", "rm", img)
	if _, err := os.Stat(filepath.Join(stateDir, "images", img)); !os.IsNotExist(err) {
		t.Errorf("images rm left the image folder: %v", err)
	}
}
