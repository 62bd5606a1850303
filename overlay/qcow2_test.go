package overlay

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"kvbox.dev/kvbox/testenv/gate"
)

func qemuImgCreate(t testing.TB, size string, opts ...string) []byte {
	p := filepath.Join(t.TempDir(), "d.qcow2")
	if out, err := exec.Command("qemu-img", append(append([]string{"create", "-q", "-f", "qcow2"}, opts...), p, size)...).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v: %s", err, out)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ReadQCOW2Header finds what qemu-img wrote: the backing file and its
// format, an external data file, the size, and opens nothing it names.
func TestReadQCOW2Header(t *testing.T) {
	gate.Tools(t, "qemu-img")
	data := filepath.Join(t.TempDir(), "data")
	for _, tc := range []struct {
		opts            []string
		backing, format string
		dataFile        string
	}{
		{nil, "", "", ""},
		{[]string{"-u", "-F", "raw", "-b", "/etc/shadow"}, "/etc/shadow", "raw", ""},
		{[]string{"-o", "data_file=" + data}, "", "", data},
		{[]string{"-o", "compat=0.10"}, "", "", ""},
	} {
		h, err := ReadQCOW2Header(bytes.NewReader(qemuImgCreate(t, "3G", tc.opts...)))
		if err != nil {
			t.Fatalf("%v: %v", tc.opts, err)
		}
		if h.VirtualSize != 3<<30 || h.BackingFile != tc.backing || h.BackingFormat != tc.format || h.DataFile != tc.dataFile || h.HasDataFile != (tc.dataFile != "") {
			t.Errorf("%v: read %+v", tc.opts, h)
		}
	}
	for _, bad := range [][]byte{nil, []byte("QFI"), []byte(strings.Repeat("x", 200)), append([]byte("QFI\xfb\x00\x00\x00\x03"), make([]byte, 200)...)} {
		if _, err := ReadQCOW2Header(bytes.NewReader(bad)); err == nil {
			t.Errorf("read a header from %q", bad)
		}
	}
}

// FuzzQCOW2Header: any bytes give a header or an error, never a backing
// file name longer than QEMU's limit.
func FuzzQCOW2Header(f *testing.F) {
	f.Add(append([]byte("QFI\xfb\x00\x00\x00\x03"), make([]byte, 200)...))
	if _, err := exec.LookPath("qemu-img"); err == nil {
		f.Add(qemuImgCreate(f, "1G", "-u", "-F", "raw", "-b", "/etc/shadow")[:4096])
		f.Add(qemuImgCreate(f, "1G", "-o", "data_file="+filepath.Join(f.TempDir(), "d"))[:4096])
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		h, err := ReadQCOW2Header(bytes.NewReader(in))
		if err == nil && (len(h.BackingFile) > qcow2MaxBackingName || h.ClusterBits < 9 || h.ClusterBits > 21) {
			t.Fatalf("accepted %+v", h)
		}
	})
}
