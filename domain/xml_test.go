package domain

import (
	"encoding/xml"
	"errors"
	"html"
	"reflect"
	"strings"
	"testing"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/templates"
)

func testData() TemplateData {
	md, _ := MarshalMeta(Meta{Image: "tiny", IP: "172.30.0.2", Prefix: 24, MAC: "52:54:00:01:02:03", Dir: "/b/x",
		Created: time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)})
	return TemplateData{
		Type: "qemu", Name: "x", Metadata: md, MemoryBytes: 256 << 20, CPUs: 1,
		Kernel: "/i/vmlinuz", Initrd: "/i/initrd.img", Cmdline: "console=ttyS0 root=/dev/vda & more",
		Disk: "/b/x/disk.qcow2", Bridge: "kvbox0", MAC: "52:54:00:01:02:03", IP: "172.30.0.2", Tap: "kvb525400010203", ConsoleLog: "/b/x/console.log",
		AgentPorts: AgentSockets("/b/x"), QemuArgs: RAMArgs(256 << 20),
	}
}

// The built-in template renders a domain whose facts read back through the
// same parser kvbox lists boxes with.
func TestRenderRoundTrip(t *testing.T) {
	out, err := Render(templates.Box, testData())
	if err != nil {
		t.Fatal(err)
	}
	d, err := parseDomainXML(out)
	if err != nil {
		t.Fatal(err)
	}
	if d.Type != "qemu" || d.Name != "x" || d.VCPU != 1 || d.memoryBytes() != 256<<20 {
		t.Errorf("parsed back %+v", d)
	}
	if d.Metadata == nil || d.Metadata.IP != "172.30.0.2" || d.Metadata.Image != "tiny" || !d.Metadata.Created.Equal(time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("metadata read back as %+v", d.Metadata)
	}
	for _, want := range []string{
		"console=ttyS0 root=/dev/vda &amp; more", // escaped
		"<target type='virtio' name='org.kvbox.agent.3'/>",
		"memory-backend-ram,id=kvbox.ram,size=268435456",
		"<genid/>",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("rendered XML lacks %q", want)
		}
	}
	if strings.Contains(out, "<vsock") || strings.Contains(out, "host-passthrough") {
		t.Errorf("a qemu domain without vsock got vsock or a host CPU:\n%s", out)
	}
	kvm := testData()
	kvm.Type, kvm.Vsock, kvm.Kernel = "kvm", true, ""
	out, err = Render(templates.Box, kvm)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<vsock model='virtio'>", "host-passthrough", "<boot dev='hd'/>"} {
		if !strings.Contains(out, want) {
			t.Errorf("kvm, vsock, disk boot: lacks %q", want)
		}
	}
}

// An operator's template that drops what every box needs is refused at
// render time, before anything is defined, with a line naming what.
func TestRenderRefusesTemplatesWithoutKvboxParts(t *testing.T) {
	for _, tc := range []struct{ cut, want string }{
		{"{{.Metadata}}", "kvbox's metadata"},
		{"{{- range .QemuArgs}}\n    <qemu:arg value='{{.}}'/>\n{{- end}}", "the memory backend"},
		{"{{- range .AgentPorts}}", "the agent channels"},
	} {
		tmpl := strings.Replace(templates.Box, tc.cut, "", 1)
		if tmpl == templates.Box {
			t.Fatalf("the built-in template has no %q", tc.cut)
		}
		if tc.want == "the agent channels" {
			// drop the whole channel block
			a := strings.Index(templates.Box, "{{- range .AgentPorts}}")
			b := strings.Index(templates.Box[a:], "{{- end}}") + a + len("{{- end}}")
			tmpl = templates.Box[:a] + templates.Box[b:]
		}
		_, err := Render(tmpl, testData())
		if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, base.ErrInvalid) {
			t.Errorf("template without %s: %v", tc.want, err)
		}
	}
	kvm := testData()
	kvm.Vsock = true
	a := strings.Index(templates.Box, "{{- if .Vsock}}")
	b := strings.Index(templates.Box[a:], "{{- end}}") + a + len("{{- end}}")
	if _, err := Render(templates.Box[:a]+templates.Box[b:], kvm); err == nil || !strings.Contains(err.Error(), "vsock") {
		t.Errorf("template without vsock on a vsock host: %v", err)
	}
}

func TestRenderRejectsBadTemplates(t *testing.T) {
	for _, tmpl := range []string{"<domain>{{.Nope}}</domain>", "<domain>{{.Name}</domain>", "<domain><name>{{.Name}}</domain>"} {
		if _, err := Render(tmpl, testData()); err == nil {
			t.Errorf("template %q rendered", tmpl)
		}
	}
}

func TestMemoryUnits(t *testing.T) {
	for unit, want := range map[string]int64{"KiB": 2 << 10, "": 2 << 10, "MiB": 2 << 20, "GiB": 2 << 30, "b": 2, "MB": 2e6} {
		var d domainXML
		if err := xml.Unmarshal([]byte("<domain><memory unit='"+unit+"'>2</memory></domain>"), &d); err != nil {
			t.Fatal(err)
		}
		if got := d.memoryBytes(); got != want {
			t.Errorf("unit %q: %d, want %d", unit, got, want)
		}
	}
}

func TestRAMArgs(t *testing.T) {
	got := RAMArgs(1 << 20)
	if got[1] != "memory-backend-ram,id=kvbox.ram,size=1048576" || got[3] != "memory-backend=kvbox.ram" {
		t.Errorf("RAMArgs = %q", got)
	}
}

// ReplaceQemuArg finds an argument raw or as libvirt escapes it, and
// writes its replacement escaped (a suspended box's RAM file, in a folder
// whose name has a comma or an ampersand); a definition without the
// argument is left as it is.
func TestReplaceQemuArg(t *testing.T) {
	anon := RAMArgs(1 << 20)[1]
	for _, dir := range []string{"/var/lib/a,b", "/var/lib/a&b"} {
		file := "memory-backend-file,id=kvbox.ram,size=1048576,mem-path=" + QemuOptEscape(dir+"/memory")
		out, ok := ReplaceQemuArg("<qemu:arg value='"+anon+"'/>", anon, file)
		if !ok || out != "<qemu:arg value='"+html.EscapeString(file)+"'/>" {
			t.Errorf("ReplaceQemuArg(%s) = %q, %v", dir, out, ok)
		}
		// Found as libvirt writes it back: escaped.
		x := "<qemu:arg value='" + html.EscapeString(file) + "'/>"
		if out, ok := ReplaceQemuArg(x, file, anon); !ok || out != "<qemu:arg value='"+anon+"'/>" {
			t.Errorf("ReplaceQemuArg(%q) = %q, %v", x, out, ok)
		}
	}
	x := "<qemu:arg value='memory-backend-ram,id=other'/>"
	if out, ok := ReplaceQemuArg(x, anon, "y"); ok || out != x {
		t.Errorf("ReplaceQemuArg replaced what is not there in %q: %q", x, out)
	}
}

// The interface is an isolated port whose tap is the name kvbox's port
// filter holds: the built-in template has both, an operator's template
// without them gets them, one that names another tap is refused.
func TestRenderFiltersInterfaces(t *testing.T) {
	out, err := Render(templates.Box, testData())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<target dev='kvb525400010203'/>", "<port isolated='yes'/>"} {
		if !strings.Contains(out, want) {
			t.Errorf("built-in template lacks %q", want)
		}
	}
	bare := strings.Replace(templates.Box, "<target dev='{{.Tap}}'/>", "", 1)
	bare = strings.Replace(bare, "<port isolated='yes'/>", "", 1)
	out, err = Render(bare, testData())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`<target dev="kvb525400010203">`, `<port isolated="yes">`, "memory-backend-ram,id=kvbox.ram,size=268435456"} {
		if !strings.Contains(out, want) {
			t.Errorf("an operator template without the tap name: rendered XML lacks %q\n%s", want, out)
		}
	}
	// --network none: no interface; a template that adds one anyway is refused.
	none := testData()
	none.Bridge, none.MAC, none.IP = "", "", ""
	if out, err := Render(templates.Box, none); err != nil || strings.Contains(out, "<interface") {
		t.Errorf("--network none: %v\n%s", err, out)
	}
	always := strings.Replace(templates.Box, "{{- if .Bridge}}\n    <interface", "{{- if true}}\n    <interface", 1)
	if _, err := Render(always, none); !errors.Is(err, base.ErrInvalid) || !strings.Contains(err.Error(), "--network none") {
		t.Errorf("a template with an interface for a --network none box: %v", err)
	}
	for name, tmpl := range map[string]string{
		"other tap":    strings.Replace(templates.Box, "dev='{{.Tap}}'", "dev='vnet99'", 1),
		"user NIC":     strings.Replace(templates.Box, "</devices>", "<interface type='user'><model type='virtio'/></interface></devices>", 1),
		"other bridge": strings.Replace(templates.Box, "<source bridge='{{.Bridge}}'/>", "<source bridge='virbr0'/>", 1),
	} {
		if _, err := Render(tmpl, testData()); !errors.Is(err, base.ErrInvalid) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: rendered or not one clear line: %v", name, err)
		}
	}
}

func TestSplitOpts(t *testing.T) {
	got := SplitQemuOpts("memory-backend-file,id=kvbox.ram,mem-path=/a,,b,size=1")
	want := []string{"memory-backend-file", "id=kvbox.ram", "mem-path=/a,b", "size=1"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("SplitQemuOpts = %q", got)
	}
}
