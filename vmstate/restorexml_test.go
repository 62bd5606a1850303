package vmstate

import (
	"encoding/xml"
	"errors"
	"io"
	"os"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"libvirt.org/go/libvirtxml"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/network"
)

// testdata/domain-migratable.xml is `virsh dumpxml --migratable` of a tiny
// box (what a snapshot keeps); testdata/domain-live.xml is plain `virsh
// dumpxml` of the same running box, with every runtime-only bit libvirt
// adds (id, aliases, seclabels, tap name, pty path, backing chain).
func readTestdata(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func testSpec(dir string) RestoreSpec {
	return RestoreSpec{
		Name: "agent-1",
		Meta: domain.Meta{
			Image: "tiny", Snapshot: "warm", IP: "172.30.0.9", Prefix: 24, Gateway: "172.30.0.1",
			MAC: "52:54:00:aa:bb:cc", Bridge: "kvbox0", Dir: dir, DiskBytes: 1 << 30,
			Transport: "virtio-serial", Created: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
		},
		Disk:     dir + "/disk.qcow2",
		MemPath:  "/var/lib/kvbox/snapshots/warm/memory",
		MemBytes: 256 << 20,
	}
}

func parseDomain(t *testing.T, s string) libvirtxml.Domain {
	t.Helper()
	var d libvirtxml.Domain
	if err := d.Unmarshal(s); err != nil {
		t.Fatalf("parse: %v\n%s", err, s)
	}
	return d
}

func qemuArgs(d libvirtxml.Domain) []string {
	var out []string
	if d.QEMUCommandline != nil {
		for _, a := range d.QEMUCommandline.Args {
			out = append(out, a.Value)
		}
	}
	return out
}

func TestCloneXML(t *testing.T) {
	const dir = "/var/lib/kvbox/boxes/agent-1"
	for _, tc := range []struct {
		file   string
		offset int64
		want   []string
	}{
		{"domain-migratable.xml", 0, []string{
			"-object", "memory-backend-file,id=kvbox.ram,size=268435456,mem-path=/var/lib/kvbox/snapshots/warm/memory,share=off,readonly=on,rom=off",
			"-machine", "memory-backend=kvbox.ram", "-incoming", "defer"}},
		{"domain-live.xml", 1 << 20, []string{
			"-object", "memory-backend-file,id=kvbox.ram,size=268435456,mem-path=/var/lib/kvbox/snapshots/warm/memory,share=off,readonly=on,rom=off,offset=1048576",
			"-machine", "memory-backend=kvbox.ram", "-incoming", "defer"}},
	} {
		t.Run(tc.file, func(t *testing.T) {
			srcXML := readTestdata(t, tc.file)
			src := parseDomain(t, srcXML)
			spec := testSpec(dir)
			spec.MemOffset = tc.offset
			out, err := RestoreXML(srcXML, spec)
			if err != nil {
				t.Fatal(err)
			}
			d := parseDomain(t, out)
			if d.Name != "agent-1" || d.UUID != "" || d.ID != nil || d.HWUUID != "" || len(d.SecLabel) != 0 {
				t.Errorf("identity: name %q uuid %q id %v seclabels %d", d.Name, d.UUID, d.ID, len(d.SecLabel))
			}
			if d.GenID == nil || d.GenID.Value != "" {
				t.Errorf("genid = %+v, want an empty <genid/> so libvirt generates a new one", d.GenID)
			}
			for _, bad := range []string{"<alias", "seclabel", "vnet", "/dev/pts", "clsrc", "backingStore", "index='1'", src.UUID} {
				if strings.Contains(out, bad) {
					t.Errorf("clone XML still holds %q", bad)
				}
			}
			// What the migration stream depends on is the source's.
			if d.Type != src.Type || !reflect.DeepEqual(d.OS.Type, src.OS.Type) || !reflect.DeepEqual(d.CPU, src.CPU) ||
				!reflect.DeepEqual(d.Memory, src.Memory) || !reflect.DeepEqual(d.VCPU, src.VCPU) || !reflect.DeepEqual(d.Features, src.Features) {
				t.Errorf("machine, CPU, memory or features changed")
			}
			if len(d.Devices.Controllers) != len(src.Devices.Controllers) || len(d.Devices.Channels) != len(src.Devices.Channels) ||
				len(d.Devices.Disks) != len(src.Devices.Disks) || len(d.Devices.RNGs) != len(src.Devices.RNGs) {
				t.Errorf("device set changed")
			}
			for i, c := range d.Devices.Controllers {
				if !reflect.DeepEqual(c.Address, src.Devices.Controllers[i].Address) {
					t.Errorf("controller %d moved: %+v", i, c.Address)
				}
			}
			dk := d.Devices.Disks[0]
			if dk.Source.File.File != dir+"/disk.qcow2" || dk.Driver.Type != "qcow2" || dk.BackingStore != nil ||
				!reflect.DeepEqual(dk.Address, src.Devices.Disks[0].Address) || dk.Target.Dev != "vda" {
				t.Errorf("disk: %+v %+v", dk.Source.File, dk.Driver)
			}
			ifc := d.Devices.Interfaces[0]
			if ifc.MAC.Address != "52:54:00:aa:bb:cc" || ifc.Source.Bridge.Bridge != "kvbox0" ||
				!reflect.DeepEqual(ifc.Address, src.Devices.Interfaces[0].Address) {
				t.Errorf("interface: %+v", ifc)
			}
			// The clone's own tap (the name kvbox's port filter holds with
			// the clone's MAC and address), no nwfilter of the source's
			// address, an isolated port.
			if ifc.Target == nil || ifc.Target.Dev != network.TapName("52:54:00:aa:bb:cc") || ifc.FilterRef != nil ||
				ifc.PortOptions == nil || ifc.PortOptions.Isolated != "yes" {
				t.Errorf("interface tap %+v, filter %+v, port %+v", ifc.Target, ifc.FilterRef, ifc.PortOptions)
			}
			want := domain.AgentSockets(dir)
			if len(d.Devices.Channels) != len(want) {
				t.Fatalf("%d channels, want %d", len(d.Devices.Channels), len(want))
			}
			for i, ch := range d.Devices.Channels {
				if ch.Target.VirtIO.Name != want[i].Name || ch.Source.UNIX.Path != want[i].Path || ch.Source.UNIX.Mode != "bind" ||
					!reflect.DeepEqual(ch.Address, src.Devices.Channels[i].Address) {
					t.Errorf("channel %d: %s at %s, want %s at %s", i, ch.Target.VirtIO.Name, ch.Source.UNIX.Path, want[i].Name, want[i].Path)
				}
			}
			for _, l := range []*libvirtxml.DomainChardevLog{d.Devices.Serials[0].Log, d.Devices.Consoles[0].Log} {
				if l == nil || l.File != dir+"/console.log" {
					t.Errorf("console log: %+v", l)
				}
			}
			if d.Devices.Serials[0].Source == nil || d.Devices.Serials[0].Source.Pty == nil {
				t.Errorf("serial is no longer a pty")
			}
			var md struct {
				Boxes []domain.Meta `xml:"box"`
			}
			if err := xml.Unmarshal([]byte("<m>"+d.Metadata.XML+"</m>"), &md); err != nil || len(md.Boxes) != 1 {
				t.Fatalf("metadata: %v %q", err, d.Metadata.XML)
			}
			if m := md.Boxes[0]; m.IP != "172.30.0.9" || m.MAC != "52:54:00:aa:bb:cc" || m.Snapshot != "warm" || m.Dir != dir {
				t.Errorf("metadata: %+v", m)
			}
			if got := qemuArgs(d); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("qemu args:\n got %q\nwant %q", got, tc.want)
			}
			// Nothing else is lost in the round trip through libvirtxml.
			lost := subtract(elementPaths(t, srcXML), elementPaths(t, out))
			stripped := map[string]bool{
				"domain/uuid": true, "domain/seclabel": true, "domain/seclabel/label": true, "domain/seclabel/imagelabel": true,
				"domain/devices/disk/backingStore": true, "domain/devices/disk/backingStore/format": true,
				"domain/devices/disk/backingStore/source": true, "domain/devices/disk/backingStore/backingStore": true,
				"domain/devices/interface/target": true, "domain/devices/serial/source": true, "domain/devices/console/source": true,
			}
			for _, p := range lost {
				if !stripped[p] && !strings.HasSuffix(p, "/alias") {
					t.Errorf("element %s of the source is missing from the clone XML", p)
				}
			}
		})
	}
}

// elementPaths lists the distinct element paths of an XML document.
func elementPaths(t *testing.T, s string) map[string]bool {
	t.Helper()
	dec := xml.NewDecoder(strings.NewReader(s))
	var stack []string
	seen := map[string]bool{}
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return seen
		}
		if err != nil {
			t.Fatal(err)
		}
		switch e := tok.(type) {
		case xml.StartElement:
			stack = append(stack, e.Name.Local)
			seen[strings.Join(stack, "/")] = true
		case xml.EndElement:
			stack = stack[:len(stack)-1]
		}
	}
}

func subtract(a, b map[string]bool) []string {
	var out []string
	for k := range a {
		if !b[k] {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

// A clone's own XML is a valid source too (template of a template): the
// previous RAM mapping and -incoming are replaced, not doubled.
func TestCloneXMLOfAClone(t *testing.T) {
	first, err := RestoreXML(readTestdata(t, "domain-live.xml"), testSpec("/b/one"))
	if err != nil {
		t.Fatal(err)
	}
	spec := testSpec("/b/two")
	spec.Name, spec.Meta.MAC, spec.MemPath, spec.MemOffset = "two", "52:54:00:00:00:02", "/s/t,x/state", 1<<20
	out, err := RestoreXML(first, spec)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"-object", "memory-backend-file,id=kvbox.ram,size=268435456,mem-path=/s/t,,x/state,share=off,readonly=on,rom=off,offset=1048576",
		"-machine", "memory-backend=kvbox.ram", "-incoming", "defer"}
	if got := qemuArgs(parseDomain(t, out)); !reflect.DeepEqual(got, want) {
		t.Errorf("qemu args:\n got %q\nwant %q", got, want)
	}
	if strings.Contains(out, "/b/one") {
		t.Errorf("the first clone's folder is still named")
	}
	// Cloned twice, the capability is still hidden once, never added.
	want1 := &libvirtxml.DomainQEMUCapabilities{Del: []libvirtxml.DomainQEMUCapabilitiesEntry{{Name: "cpu-unavailable-features"}}}
	for i, x := range []string{first, out} {
		if got := parseDomain(t, x).QEMUCapabilities; got == nil || !reflect.DeepEqual(got.Del, want1.Del) || len(got.Add) != 0 {
			t.Errorf("clone %d: qemu:capabilities = %+v, want one del of cpu-unavailable-features", i+1, got)
		}
	}
	if n := strings.Count(out, "cpu-unavailable-features"); n != 1 {
		t.Errorf("cpu-unavailable-features named %d times, want 1", n)
	}
}

func TestWithoutCPUUnavailableFeaturesKeepsOthers(t *testing.T) {
	in := &libvirtxml.DomainQEMUCapabilities{
		Add: []libvirtxml.DomainQEMUCapabilitiesEntry{{Name: "blockdev"}, {Name: "cpu-unavailable-features"}},
		Del: []libvirtxml.DomainQEMUCapabilitiesEntry{{Name: "foo"}},
	}
	got := withoutCPUUnavailableFeatures(in)
	if !reflect.DeepEqual(got.Add, []libvirtxml.DomainQEMUCapabilitiesEntry{{Name: "blockdev"}}) ||
		!reflect.DeepEqual(got.Del, []libvirtxml.DomainQEMUCapabilitiesEntry{{Name: "foo"}, {Name: "cpu-unavailable-features"}}) {
		t.Errorf("got %+v", got)
	}
}

// The definition for the clone's next cold boot: anonymous RAM, no
// -incoming, the UUID libvirt gave the clone.
func TestCloneXMLBoot(t *testing.T) {
	spec := testSpec("/b/one")
	spec.UUID, spec.Boot = "6c3e1c1e-0000-4000-8000-000000000001", true
	out, err := RestoreXML(readTestdata(t, "domain-migratable.xml"), spec)
	if err != nil {
		t.Fatal(err)
	}
	d := parseDomain(t, out)
	want := []string{"-object", "memory-backend-ram,id=kvbox.ram,size=268435456", "-machine", "memory-backend=kvbox.ram"}
	if got := qemuArgs(d); !reflect.DeepEqual(got, want) || d.UUID != spec.UUID {
		t.Errorf("uuid %q, qemu args %q", d.UUID, got)
	}
}

func mustCloneXML(t *testing.T, spec RestoreSpec) string {
	t.Helper()
	out, err := RestoreXML(readTestdata(t, "domain-migratable.xml"), spec)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestCloneXMLKeepsForeignMetadataAndArgs(t *testing.T) {
	src := readTestdata(t, "domain-migratable.xml")
	src = strings.Replace(src, "<metadata>", `<metadata>
    <other:thing xmlns:other="https://example.com/x"><other:v a="1">keep me</other:v></other:thing>`, 1)
	src = strings.Replace(src, "<qemu:commandline>", `<qemu:commandline>
    <qemu:arg value='-msg'/>
    <qemu:arg value='guest-name=on'/>`, 1)
	out, err := RestoreXML(src, testSpec("/b/one"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, `<other:thing xmlns:other="https://example.com/x"><other:v a="1">keep me</other:v></other:thing>`) {
		t.Errorf("foreign metadata lost:\n%s", out)
	}
	if n := strings.Count(out, "<box xmlns=\"https://kvbox.dev/xmlns/box/1\">"); n != 1 {
		t.Errorf("%d kvbox metadata elements", n)
	}
	args := qemuArgs(parseDomain(t, out))
	if len(args) < 2 || args[0] != "-msg" || args[1] != "guest-name=on" {
		t.Errorf("other qemu args lost: %q", args)
	}
}

func TestCloneXMLErrors(t *testing.T) {
	src := readTestdata(t, "domain-migratable.xml")
	noRAM := strings.Replace(src, "id=kvbox.ram", "id=other", 1)
	noCmd := src[:strings.Index(src, "<qemu:commandline>")] + "</domain>"
	twoNICs := strings.Replace(src, "<interface type='bridge'>", "<interface type='bridge'><mac address='52:54:00:00:00:01'/><source bridge='kvbox0'/></interface>\n<interface type='bridge'>", 1)
	noAgent := strings.ReplaceAll(src, "org.kvbox.agent.", "org.example.")
	for name, tc := range map[string]struct {
		xml  string
		edit func(*RestoreSpec)
	}{
		"not xml":          {"<domain", nil},
		"no RAM backend":   {noRAM, nil},
		"no commandline":   {noCmd, nil},
		"two interfaces":   {twoNICs, nil},
		"no agent channel": {noAgent, nil},
		"size mismatch":    {src, func(s *RestoreSpec) { s.MemBytes = 512 << 20 }},
		"no name":          {src, func(s *RestoreSpec) { s.Name = "" }},
	} {
		spec := testSpec("/b/one")
		if tc.edit != nil {
			tc.edit(&spec)
		}
		if name == "no agent channel" && domain.Transport() == "vsock" {
			continue
		}
		if out, err := RestoreXML(tc.xml, spec); err == nil {
			t.Errorf("%s: no error; got\n%s", name, out)
		}
	}
}

// A source on a vsock host holds a CID while it runs; the clone must ask
// libvirt for its own.
func TestCloneXMLVsockGetsItsOwnCID(t *testing.T) {
	src := strings.Replace(readTestdata(t, "domain-live.xml"), "</devices>",
		"<vsock model='virtio'><cid auto='yes' address='3'/></vsock></devices>", 1)
	out, err := RestoreXML(src, testSpec("/var/lib/kvbox/boxes/agent-1"))
	if err != nil {
		t.Fatal(err)
	}
	d := parseDomain(t, out)
	if d.Devices.VSock == nil || d.Devices.VSock.CID == nil || d.Devices.VSock.CID.Auto != "yes" || d.Devices.VSock.CID.Address != "" {
		t.Fatalf("clone vsock: %+v", d.Devices.VSock)
	}
}

// A clone runs QEMU under this host's static DAC label, whatever label the
// source had: libvirt then relabels nothing the clone builds on.
func TestCloneXMLStaticDACLabel(t *testing.T) {
	src := strings.Replace(readTestdata(t, "domain-live.xml"), "</devices>",
		"</devices><seclabel type='dynamic' model='dac' relabel='yes'><label>+107:+107</label></seclabel>", 1)
	s := testSpec("/var/lib/kvbox/boxes/agent-1")
	s.DACLabel = "+64055:+64055"
	out, err := RestoreXML(src, s)
	if err != nil {
		t.Fatal(err)
	}
	d := parseDomain(t, out)
	if len(d.SecLabel) != 1 || d.SecLabel[0].Type != "static" || d.SecLabel[0].Model != "dac" || d.SecLabel[0].Relabel != "no" || d.SecLabel[0].Label != "+64055:+64055" {
		t.Fatalf("clone seclabels: %+v", d.SecLabel)
	}
}

// A clone's balloon offers free page hints where its source's, booted
// from an image, does not (templates/box.xml); a snapshot without kvbox's
// override of the balloon gets none.
func TestCloneXMLOffersFreePageHints(t *testing.T) {
	base := readTestdata(t, "domain-live.xml")
	override := `<qemu:override xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'><qemu:device alias='balloon0'><qemu:frontend>` +
		`<qemu:property name='free-page-hint' type='bool' value='false'/><qemu:property name='iothread' type='string' value='iothread1'/>` +
		`</qemu:frontend></qemu:device></qemu:override></domain>`
	src := strings.Replace(base, "</domain>", override, 1)
	out, err := RestoreXML(src, testSpec("/var/lib/kvbox/boxes/agent-1"))
	if err != nil {
		t.Fatal(err)
	}
	d := parseDomain(t, out)
	if d.QEMUOverride == nil || len(d.QEMUOverride.Devices) != 1 {
		t.Fatalf("override = %+v", d.QEMUOverride)
	}
	props := d.QEMUOverride.Devices[0].Frontend.Properties
	if len(props) != 2 || props[0].Name != "free-page-hint" || props[0].Value != "true" || props[1].Value != "iothread1" {
		t.Errorf("the clone's balloon properties are %+v, want free-page-hint true and the iothread kept", props)
	}
	// The clone's next cold boot has anonymous RAM: no hints, whatever
	// its snapshot's XML (a clone's) offered.
	boot := testSpec("/var/lib/kvbox/boxes/agent-1")
	boot.UUID, boot.Boot = "6c3e1c1e-0000-4000-8000-000000000001", true
	out, err = RestoreXML(strings.Replace(src, "value='false'", "value='true'", 1), boot)
	if err != nil {
		t.Fatal(err)
	}
	if p := parseDomain(t, out).QEMUOverride.Devices[0].Frontend.Properties[0]; p.Value != "false" {
		t.Errorf("the clone's next boot has free-page-hint %q, want false", p.Value)
	}
	out, err = RestoreXML(base, testSpec("/var/lib/kvbox/boxes/agent-1"))
	if err != nil {
		t.Fatal(err)
	}
	if d := parseDomain(t, out); d.QEMUOverride != nil {
		t.Errorf("a snapshot with no balloon override got one: %+v", d.QEMUOverride)
	}
}
