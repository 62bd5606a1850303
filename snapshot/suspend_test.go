package snapshot

import (
	"strings"
	"testing"

	"kvbox.dev/kvbox/domain"
)

func TestSuspendedXML(t *testing.T) {
	b := domain.Box{Name: "dev", MemoryBytes: 256 << 20, Meta: domain.Meta{Dir: "/var/lib/kvbox/boxes/dev"}}
	// Anonymous RAM, and the RAM file of a box an earlier kvbox defined.
	var boot string
	for _, arg := range []string{domain.RAMArgs(b.MemoryBytes)[1], domain.LegacyRAMArgs(b.MemoryBytes, domain.MemoryFile(b.Dir))[1]} {
		boot = "<domain><name>dev</name><qemu:commandline><qemu:arg value='-object'/><qemu:arg value='" + arg +
			"'/><qemu:arg value='-machine'/><qemu:arg value='memory-backend=kvbox.ram'/></qemu:commandline></domain>"
		got, err := suspendedXML(boot, b)
		if err != nil {
			t.Fatal(err)
		}
		want := "mem-path=/var/lib/kvbox/boxes/dev/SUSPENDED-run-kvbox-resume-dev/memory,share=on"
		if !strings.Contains(got, want) || strings.Contains(got, "mem-path=/var/lib/kvbox/boxes/dev/memory,") {
			t.Errorf("suspended XML does not map the missing folder:\n%s", got)
		}
		if n := strings.Count(got, "memory-backend-"); n != 1 {
			t.Errorf("suspended XML has %d RAM backends", n)
		}
	}
	// A definition without kvbox's RAM backend (or another size) is refused.
	for _, bad := range []string{"<domain/>", strings.Replace(boot, "size=268435456", "size=1", 1)} {
		if _, err := suspendedXML(bad, b); err == nil {
			t.Errorf("suspendedXML accepted %q", bad)
		}
	}
}
