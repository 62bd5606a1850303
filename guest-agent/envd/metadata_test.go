package envd

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// An upload writes the file in place (its inode and mode stay) and makes
// its X-Metadata-* headers the file's metadata, keys lowercased, replacing
// what it had; Stat reads it back; bad metadata is refused before anything
// is written.
func TestUploadInPlaceWithMetadata(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "m.txt")
	if err := os.WriteFile(f, []byte("old content, longer"), 0o600); err != nil {
		t.Fatal(err)
	}
	var before syscall.Stat_t
	syscall.Stat(f, &before)
	_, addr := newTestServer(t, Config{})
	post := func(body string, headers ...string) (int, string) {
		t.Helper()
		resp, b := roundTrip(t, addr, request("POST", "/files?path="+url.QueryEscape(f), append([]string{"Content-Type: application/octet-stream"}, headers...), []byte(body)))
		return resp.StatusCode, string(b)
	}
	if s, b := post("new", "X-Metadata-Owner: ci", "x-metadata-job: 17"); s != 200 || !strings.Contains(b, `"metadata":{"job":"17","owner":"ci"}`) {
		t.Fatalf("upload with metadata: %d %s", s, b)
	}
	var after syscall.Stat_t
	syscall.Stat(f, &after)
	if after.Ino != before.Ino || after.Mode&0o777 != 0o600 {
		t.Errorf("the upload made another file (inode %d, was %d) or changed its mode (%o)", after.Ino, before.Ino, after.Mode&0o777)
	}
	if b, _ := os.ReadFile(f); string(b) != "new" {
		t.Errorf("content %q", b)
	}
	if v, err := getxattr(f, "user.e2b.owner"); err != nil || v != "ci" {
		t.Errorf("xattr user.e2b.owner: %q %v", v, err)
	}
	_, b := roundTrip(t, addr, unary("filesystem.Filesystem/Stat", fmt.Sprintf(`{"path":%q}`, f)))
	if !strings.Contains(string(b), `"metadata":{"job":"17","owner":"ci"}`) && !strings.Contains(compact(string(b)), `"metadata":{"job":"17","owner":"ci"}`) {
		t.Errorf("Stat lacks the metadata: %s", b)
	}
	// The next upload's metadata replaces it all; one without any clears it.
	if s, b := post("again", "X-Metadata-Job: 18"); s != 200 || !strings.Contains(b, `"metadata":{"job":"18"}`) {
		t.Errorf("second upload: %d %s", s, b)
	}
	if _, err := getxattr(f, "user.e2b.owner"); err == nil {
		t.Errorf("a key the second upload lacked is still there")
	}
	if s, b := post("plain"); s != 200 || strings.Contains(b, "metadata") {
		t.Errorf("upload without metadata: %d %s", s, b)
	}
	// Refused, and the file untouched.
	for _, h := range []string{"X-Metadata-K: caf\xc3\xa9", "X-Metadata-" + strings.Repeat("k", 256) + ": v", "X-Metadata-Big: " + strings.Repeat("v", 5000)} {
		if s, b := post("should not land", h); s != 400 {
			t.Errorf("%.40s: %d %s, want 400", h, s, b)
		}
	}
	if b, _ := os.ReadFile(f); string(b) != "plain" {
		t.Errorf("a refused upload wrote the file: %q", b)
	}
}

func getxattr(path, name string) (string, error) {
	buf := make([]byte, 256)
	n, err := unix.Getxattr(path, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// A watch of a directory on a network filesystem is refused unless the
// request allows network mounts; a local one is watched either way.
func TestWatchNetworkMounts(t *testing.T) {
	dir := t.TempDir()
	if network, err := onNetworkMount(dir); err != nil || network {
		t.Fatalf("the test's folder counts as a network mount: %v %v", network, err)
	}
	_, addr := newTestServer(t, Config{})
	watch := func(allow bool) (int, string) {
		t.Helper()
		resp, b := roundTrip(t, addr, unary("filesystem.Filesystem/CreateWatcher", fmt.Sprintf(`{"path":%q,"allowNetworkMounts":%v}`, dir, allow)))
		return resp.StatusCode, string(b)
	}
	if s, b := watch(false); s != 200 {
		t.Errorf("a local folder: %d %s", s, b)
	}
	orig := fsType
	t.Cleanup(func() { fsType = orig })
	fsType = func(string) (int64, error) { return 0x6969, nil } // NFS's
	if s, b := watch(false); s != 400 || !strings.Contains(b, "network filesystem") {
		t.Errorf("an NFS folder without allowNetworkMounts: %d %s, want 400 naming it", s, b)
	}
	if s, b := watch(true); s != 200 {
		t.Errorf("an NFS folder with allowNetworkMounts: %d %s", s, b)
	}
}
