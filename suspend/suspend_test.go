package suspend

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
)

func TestSuspendedXML(t *testing.T) {
	b := domain.Box{Name: "dev", MemoryBytes: 256 << 20, Meta: domain.Meta{Dir: "/var/lib/kvbox/boxes/dev"}}
	boot := "<domain><name>dev</name><qemu:commandline><qemu:arg value='-object'/><qemu:arg value='" + domain.RAMArgs(b.MemoryBytes)[1] +
		"'/><qemu:arg value='-machine'/><qemu:arg value='memory-backend=kvbox.ram'/></qemu:commandline></domain>"
	got, err := suspendedXML(boot, b)
	if err != nil {
		t.Fatal(err)
	}
	want := "memory-backend-file,id=kvbox.ram,size=268435456,mem-path=/var/lib/kvbox/boxes/dev/SUSPENDED-run-kvbox-resume-dev/memory,share=on"
	if !strings.Contains(got, want) {
		t.Errorf("suspended XML does not map the missing folder:\n%s", got)
	}
	if n := strings.Count(got, "memory-backend-"); n != 1 {
		t.Errorf("suspended XML has %d RAM backends", n)
	}
	// A definition without kvbox's RAM backend (or another size) is refused.
	for _, bad := range []string{"<domain/>", strings.Replace(boot, "size=268435456", "size=1", 1)} {
		if _, err := suspendedXML(bad, b); err == nil {
			t.Errorf("suspendedXML accepted %q", bad)
		}
	}
}

// A guest that put itself to sleep (ACPI S3: libvirt's pmsuspended) is
// not a box kvbox suspended: resume refuses it in one line, where it took
// it for a suspended box and read the saved state its metadata does not
// have (a nil pointer).
func TestResumeRefusesASleepingGuest(t *testing.T) {
	dir := t.TempDir()
	md, err := domain.MarshalMeta(domain.Meta{Dir: filepath.Join(dir, "boxes", "sleeper"), Transport: "virtio-serial", Created: time.Now().UTC()})
	if err != nil {
		t.Fatal(err)
	}
	// libvirt's test driver, from a file of our own: a domain in state 7
	// (VIR_DOMAIN_PMSUSPENDED), which no driver call can put it in.
	node := filepath.Join(dir, "node.xml")
	x := `<node><domain type='test' xmlns:test='http://libvirt.org/schemas/domain/test/1.0'><name>sleeper</name>
<memory unit='KiB'>65536</memory><vcpu>1</vcpu><os><type>hvm</type></os><metadata>` + md + `</metadata>
<test:runstate>7</test:runstate></domain></node>`
	if err := os.WriteFile(node, []byte(x), 0o600); err != nil {
		t.Fatal(err)
	}
	conn, err := libvirt.NewConnect("test://" + node)
	if err != nil {
		t.Skipf("libvirt's test driver: %v", err)
	}
	defer conn.Close()
	h := &domain.Host{StateDir: dir}
	h.SetConn(conn)
	b, err := h.Get("sleeper")
	if err != nil {
		t.Fatal(err)
	}
	if b.State != domain.StatePMSuspended {
		t.Fatalf("a guest in S3 is listed %q, want %q", b.State, domain.StatePMSuspended)
	}
	_, err = Resume(context.Background(), h, "sleeper", time.Second)
	if !errors.Is(err, base.ErrBusy) || !strings.Contains(err.Error(), "put to sleep by its own guest") {
		t.Errorf("resume of a sleeping guest: %v", err)
	}
}
