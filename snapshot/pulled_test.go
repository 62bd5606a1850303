package snapshot

import (
	"os"
	"strings"
	"testing"

	"libvirt.org/go/libvirtxml"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/vmstate"
)

// pushedSpec is what a pull of testdata/pushed-*.xml (snapshots a kvbox
// took of a tiny box and of a clone of it, with the pushing host's state
// dir at /var/lib/kvbox-src) checked.
func pushedSpec() PulledSpec {
	const src = "/var/lib/kvbox-src/images/tiny/v-20261205T175226.609027141"
	return PulledSpec{
		Dir: "/var/lib/kvbox/snapshots/warm", Image: "tiny", DiskBytes: 1 << 30, MemoryBytes: 256 << 20, CPUs: 1,
		Kernel: "/var/lib/kvbox/images/tiny/v-1/vmlinuz", Initrd: "/var/lib/kvbox/images/tiny/v-1/initrd.img",
		SrcKernel: src + "/vmlinuz", SrcInitrd: src + "/initrd.img",
		Emulator: "/var/lib/kvbox/libexec/qemu-system-x86_64", SrcWrapper: "/var/lib/kvbox-src/libexec/qemu-system-x86_64",
		Compat: Compat{DomainType: "qemu", Arch: "x86_64", Machine: "pc-q35-10.0", CPUMode: "custom", CPUModel: "qemu64"},
	}
}

// The domain XML of a pulled snapshot is kvbox's template with the
// pushed machine, CPU, sizes and device addresses: this host's paths
// only, and a clone's XML derives from it.
func TestPulledXML(t *testing.T) {
	for _, f := range []string{"testdata/pushed-box.xml", "testdata/pushed-clone.xml"} {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		p := pushedSpec()
		x, notes, err := PulledXML(string(src), p)
		if err != nil || len(notes) != 0 {
			t.Fatalf("%s: %v %v", f, err, notes)
		}
		if msg := checkPulled(x, p); msg != "" {
			t.Errorf("%s: %s\n%s", f, msg, x)
		}
		var s, d libvirtxml.Domain
		s.Unmarshal(string(src))
		d.Unmarshal(x)
		if d.OS.Type.Machine != "pc-q35-10.0" || d.CPU == nil || d.CPU.Model.Value != "qemu64" || len(d.Devices.Controllers) != len(s.Devices.Controllers) ||
			*d.Devices.Disks[0].Address.PCI.Bus != *s.Devices.Disks[0].Address.PCI.Bus {
			t.Errorf("%s: the machine, CPU, controllers or addresses are not the pushed ones:\n%s", f, x)
		}
		if _, err := vmstate.RestoreXML(x, vmstate.RestoreSpec{Name: "c", Meta: domain.Meta{Dir: "/b/c", MAC: "52:54:00:00:00:01", IP: "172.30.0.9", Bridge: "kvbox0"},
			Disk: "/b/c/disk.qcow2", MemPath: p.Dir + "/state", MemOffset: 1 << 20, MemBytes: p.MemoryBytes}); err != nil {
			t.Errorf("%s: a clone's XML: %v", f, err)
		}
		// what kvbox writes, pulled again (its paths now the pushing
		// host's), is what it wrote
		if x2, _, err := PulledXML(x, again(p)); err != nil || x2 != x {
			t.Errorf("%s: pulled twice: %v\n%s", f, err, x2)
		}
	}
}

// again is the spec of a pull of what p's pull installed, from the host
// it was installed on.
func again(p PulledSpec) PulledSpec {
	p.SrcKernel, p.SrcInitrd, p.SrcWrapper = p.Kernel, p.Initrd, p.Emulator
	return p
}

// checkPulled says what in a pulled snapshot's domain XML is not kvbox's
// own ("" when nothing): a QEMU argument or override beyond kvbox's, a
// device beyond its set, a path outside this host's files for it, a group.
func checkPulled(x string, p PulledSpec) string {
	var d libvirtxml.Domain
	if err := d.Unmarshal(x); err != nil {
		return "does not parse: " + err.Error()
	}
	if extra := nonZero(&d, "Type", "Name", "GenID", "Metadata", "Memory", "CurrentMemory", "VCPU", "IOThreads", "OS", "Features", "CPU",
		"Clock", "OnPoweroff", "OnReboot", "OnCrash", "Devices", "QEMUCommandline", "QEMUOverride"); len(extra) > 0 {
		return "has <" + extra[0] + ">"
	}
	want := domain.RAMArgs(p.MemoryBytes)
	if d.QEMUCommandline == nil || len(d.QEMUCommandline.Args) != len(want) || len(d.QEMUCommandline.Envs) != 0 {
		return "qemu:commandline is not kvbox's RAM backend"
	}
	for i, a := range d.QEMUCommandline.Args {
		if a.Value != want[i] {
			return "qemu:commandline is not kvbox's RAM backend"
		}
	}
	if o := d.QEMUOverride; o != nil && (len(o.Devices) != 1 || o.Devices[0].Alias != "balloon0") {
		return "qemu:override is not kvbox's"
	}
	dl := d.Devices
	if extra := nonZero(dl, "Emulator", "Disks", "Controllers", "Interfaces", "Serials", "Consoles", "Channels", "Inputs", "Audios",
		"Watchdogs", "MemBalloon", "RNGs", "VSock", "IOMMU"); len(extra) > 0 {
		return "has a <" + extra[0] + "> device"
	}
	if dl.Emulator != p.Emulator || len(dl.Disks) != 1 || dl.Disks[0].Source.File.File != p.Dir+"/disk.qcow2" || len(dl.Interfaces) > 1 ||
		len(dl.Serials) != 1 || len(dl.Consoles) != 1 || len(dl.RNGs) != 1 || dl.RNGs[0].Backend.Random == nil {
		return "devices are not kvbox's set"
	}
	for _, ch := range dl.Channels {
		if ch.Source.UNIX == nil || !strings.HasPrefix(ch.Source.UNIX.Path, p.Dir+"/") {
			return "a channel outside the snapshot's folder"
		}
	}
	if len(dl.Interfaces) == 1 && (dl.Interfaces[0].Source.Bridge == nil || dl.Interfaces[0].Script != nil) {
		return "an interface not on a bridge"
	}
	if d.OS.Kernel != "" && d.OS.Kernel != p.Kernel || d.OS.Initrd != "" && d.OS.Initrd != p.Initrd || d.OS.Loader != nil {
		return "boots something else than the image's kernel"
	}
	if m, _, _ := domain.MetaOfXML(x); m.Group != "" {
		return "is in a group"
	}
	return ""
}

// FuzzPulledXML: whatever the pushed domain XML, what PulledXML accepts
// is kvbox's own (checkPulled), and pulled again gives the same XML.
func FuzzPulledXML(f *testing.F) {
	for _, p := range []string{"testdata/pushed-box.xml", "testdata/pushed-clone.xml", "../vmstate/testdata/domain-migratable.xml"} {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(string(b))
			s := string(b)
			f.Add(strings.Replace(s, "</devices>", "<hostdev mode='subsystem' type='pci'/></devices>", 1))
			f.Add(strings.Replace(s, "<qemu:arg value='-machine'/>", "<qemu:arg value='-netdev'/><qemu:arg value='user,id=x'/><qemu:arg value='-machine'/>", 1))
			f.Add(strings.Replace(s, "<serial type='pty'>", "<serial type='file'><source path='/etc/passwd'/>", 1))
		}
	}
	f.Fuzz(func(t *testing.T, src string) {
		p := pushedSpec()
		x, _, err := PulledXML(src, p)
		if err != nil {
			return
		}
		if msg := checkPulled(x, p); msg != "" {
			t.Fatalf("accepted XML that %s:\n%s\nfrom:\n%s", msg, x, src)
		}
		if x2, _, err := PulledXML(x, again(p)); err != nil || x2 != x {
			t.Fatalf("pulled twice differs (%v):\n%s\n%s", err, x, x2)
		}
	})
}

// A pushed snapshot's RAM is bounded from above too: a domain XML (and a
// snapshot.json) that agree on 2 TiB are refused, whatever else matches.
func TestPulledXMLBoundsMemory(t *testing.T) {
	src, err := os.ReadFile("testdata/pushed-box.xml")
	if err != nil {
		t.Fatal(err)
	}
	const huge = 2 << 40
	x := strings.Replace(string(src), "<memory unit='KiB'>262144</memory>", "<memory unit='KiB'>2147483648</memory>", 1)
	x = strings.Replace(x, "<currentMemory unit='KiB'>262144</currentMemory>", "<currentMemory unit='KiB'>2147483648</currentMemory>", 1)
	x = strings.Replace(x, "size=268435456", "size=2199023255552", 1)
	if x == string(src) || !strings.Contains(x, "2199023255552") {
		t.Fatal("the test XML did not change")
	}
	p := pushedSpec()
	p.MemoryBytes = huge
	if _, _, err := PulledXML(x, p); err == nil || !strings.Contains(err.Error(), "memory size") {
		t.Errorf("a pushed snapshot of 2 TiB of RAM: %v; want it refused for its memory size", err)
	}
	// The same edit at 512 MiB passes: the bound is what refused it.
	y := strings.NewReplacer("2147483648", "524288", "2199023255552", "536870912").Replace(x)
	p.MemoryBytes = 512 << 20
	if _, _, err := PulledXML(y, p); err != nil {
		t.Errorf("the same edit at 512 MiB: %v", err)
	}
}

// A snapshot's owner mark reads back as written; a snapshot without one
// has none, and a mark that is no JSON is an error, not "no owner".
func TestOwnerMark(t *testing.T) {
	s := Snapshot{Name: "pod-sha256-ab", Dir: t.TempDir()}
	if _, ok, err := OwnerOf(s); ok || err != nil {
		t.Fatalf("an unmarked snapshot: ok %v, %v", ok, err)
	}
	want := Owner{Owner: OwnerKvboxNode, Digest: "sha256:" + strings.Repeat("ab", 32)}
	if err := SetOwner(s, want); err != nil {
		t.Fatal(err)
	}
	if got, ok, err := OwnerOf(s); !ok || err != nil || got != want {
		t.Errorf("OwnerOf = %+v, %v, %v; want %+v", got, ok, err, want)
	}
	if fi, err := os.Stat(s.Dir + "/" + OwnerFile); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the mark's file: %v, %v; want root's alone (0600)", fi.Mode(), err)
	}
	if err := os.WriteFile(s.Dir+"/"+OwnerFile, []byte("not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := OwnerOf(s); ok || err == nil {
		t.Errorf("a garbled mark: ok %v, err %v; want an error", ok, err)
	}
	if err := SetOwner(s, Owner{}); err == nil {
		t.Error("a mark without an owner was written")
	}
}
