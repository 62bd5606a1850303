package image

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/testenv/gate"
)

// A qcow2 with an external data file would let a box read and write that
// host path: import refuses it before copying anything, and leaves the store
// untouched.
func TestImportRefusesExternalDataFile(t *testing.T) {
	gate.Tools(t, "qemu-img")
	dir := t.TempDir()
	secret := filepath.Join(dir, "host-secret")
	if err := os.WriteFile(secret, []byte("host secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(dir, "evil.qcow2")
	out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-o", "data_file="+secret, disk, "1M").CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	st := Store{Dir: filepath.Join(dir, "images")}
	_, err = st.Import("evil", ImportOptions{Disk: disk, Agent: "no"})
	if !errors.Is(err, base.ErrInvalid) || !strings.Contains(err.Error(), "external file "+secret) {
		t.Fatalf("import of a qcow2 with a data file: got %v, want an ErrInvalid naming %s", err, secret)
	}
	if _, err := os.Stat(st.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("refused import left %s behind (stat: %v)", st.Dir, err)
	}
}

// Get and Remove validate the name: "../.." must not reach outside the store.
func TestStoreNamesStayInside(t *testing.T) {
	dir := t.TempDir()
	outside := filepath.Join(dir, "outside")
	if err := os.MkdirAll(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(outside, metaFile), []byte(`{"name":"outside"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	st := Store{Dir: filepath.Join(dir, "images")}
	if err := os.MkdirAll(st.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"../outside", "..", "../..", "/etc", "a/b", ""} {
		if _, err := st.Get(name); !errors.Is(err, base.ErrInvalid) {
			t.Errorf("Get(%q) = %v, want ErrInvalid", name, err)
		}
		if err := st.Remove(name); !errors.Is(err, base.ErrInvalid) {
			t.Errorf("Remove(%q) = %v, want ErrInvalid", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(outside, metaFile)); err != nil {
		t.Fatalf("the folder outside the store was touched: %v", err)
	}
}

// List skips the work folder of a build in progress: `kvbox images ls`
// beside `kvbox images build` failed on it ("invalid: name
// ".build-debian-ssh-1504965629" ...").
func TestListSkipsBuildsInProgress(t *testing.T) {
	st := Store{Dir: t.TempDir()}
	if err := os.MkdirAll(filepath.Join(st.Dir, ".build-debian-ssh-1504965629"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(st.Dir, ".build-debian-ssh.lock"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	ims, err := st.List()
	if err != nil || len(ims) != 0 {
		t.Fatalf("List() = %v, %v; want no images and no error", ims, err)
	}
}
