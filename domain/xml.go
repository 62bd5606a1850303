package domain

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"html"
	"strings"
	"text/template"

	"kvbox.dev/kvbox/base"
)

// AgentPort is one virtio-serial channel the guest agent serves.
type AgentPort struct {
	Name string // the port's name in the guest: org.kvbox.agent.N
	Path string // the unix socket QEMU binds on the host
}

// TemplateData is what a domain template is rendered with. Strings are
// XML-escaped by Render; Metadata is an XML fragment and is not.
type TemplateData struct {
	Type        string // kvm or qemu
	Emulator    string // the QEMU binary libvirt runs; empty: libvirt's default
	Name        string
	Metadata    string
	MemoryBytes int64
	CPUs        int
	Kernel      string
	Initrd      string
	Cmdline     string
	Disk        string
	Bridge      string
	MAC         string
	IP          string // the box's address, pinned by the port filter
	Tap         string // the box's tap device (network.TapName), which kvbox's port filter holds
	Group       string // the box group it is in: its port is not isolated (empty: it is)
	ConsoleLog  string
	AgentPorts  []AgentPort
	Vsock       bool
	QemuArgs    []string
	// DACLabel is "+UID:+GID" of the user QEMU runs as. The template puts
	// it in a static DAC seclabel, so libvirt runs QEMU as that user
	// without relabelling (chowning) anything: the base images and
	// snapshot files a box builds on stay root's, read-only to QEMU
	// through its group, and kvbox gives QEMU what it may write itself.
	DACLabel string
}

// Render renders a domain template.
func Render(tmpl string, d TemplateData) (string, error) {
	t, err := template.New("domain").Option("missingkey=error").Parse(tmpl)
	if err != nil {
		return "", base.Errorf(base.Invalid, "domain template: %v", err)
	}
	e := d
	for _, s := range []*string{&e.Type, &e.Emulator, &e.Name, &e.Kernel, &e.Initrd, &e.Cmdline, &e.Disk, &e.Bridge, &e.Group, &e.MAC, &e.IP, &e.ConsoleLog} {
		*s = html.EscapeString(*s)
	}
	e.AgentPorts = nil
	for _, p := range d.AgentPorts {
		e.AgentPorts = append(e.AgentPorts, AgentPort{Name: html.EscapeString(p.Name), Path: html.EscapeString(p.Path)})
	}
	e.QemuArgs = nil
	for _, a := range d.QemuArgs {
		e.QemuArgs = append(e.QemuArgs, html.EscapeString(a))
	}
	var b bytes.Buffer
	if err := t.Execute(&b, e); err != nil {
		return "", base.Errorf(base.Invalid, "domain template: %v", err)
	}
	var probe struct{}
	if err := xml.Unmarshal(b.Bytes(), &probe); err != nil {
		return "", base.Errorf(base.Invalid, "domain template renders invalid XML: %v", err)
	}
	if err := checkRendered(b.String(), e); err != nil {
		return "", err
	}
	return filterInterfaces(b.String(), d)
}

// checkRendered refuses a domain an operator's template rendered without
// what kvbox needs from every box: its metadata (the box's only record),
// the memory backend arguments (clones map a snapshot's RAM under its id) and the
// agent's channels (or vsock). Without them define would succeed and the
// box fail later, or never be seen as a box at all.
func checkRendered(out string, e TemplateData) error {
	need := func(what, hint string) error {
		return base.Errorf(base.Invalid, "the domain template drops %s; keep %s as in the built-in template (kvbox's templates/box.xml)", what, hint)
	}
	d, err := parseDomainXML(out)
	if err != nil || d.Metadata == nil {
		return need("kvbox's metadata", "{{.Metadata}} inside <metadata>")
	}
	for _, a := range e.QemuArgs {
		if !strings.Contains(out, a) {
			return need("the memory backend", "the qemu:commandline range over {{.QemuArgs}}")
		}
	}
	for _, p := range e.AgentPorts {
		if !strings.Contains(out, p.Path) || !strings.Contains(out, p.Name) {
			return need("the agent channels", "the <channel> range over {{.AgentPorts}}")
		}
	}
	if e.Vsock && !strings.Contains(out, "<vsock") {
		return need("the vsock device", "the {{if .Vsock}} <vsock> element")
	}
	return nil
}

// domainXML is the part of a libvirt domain description kvbox reads.
type domainXML struct {
	XMLName xml.Name `xml:"domain"`
	Type    string   `xml:"type,attr"`
	ID      string   `xml:"id,attr"`
	Name    string   `xml:"name"`
	UUID    string   `xml:"uuid"`
	Memory  struct {
		Unit  string `xml:"unit,attr"`
		Value int64  `xml:",chardata"`
	} `xml:"memory"`
	VCPU     int   `xml:"vcpu"`
	Metadata *Meta `xml:"metadata>box"`
	Devices  struct {
		Interfaces []struct {
			MAC struct {
				Address string `xml:"address,attr"`
			} `xml:"mac"`
			Target struct {
				Dev string `xml:"dev,attr"`
			} `xml:"target"`
		} `xml:"interface"`
		Vsock *struct {
			CID struct {
				Address uint32 `xml:"address,attr"`
			} `xml:"cid"`
		} `xml:"vsock"`
	} `xml:"devices"`
}

func parseDomainXML(s string) (domainXML, error) {
	var d domainXML
	if err := xml.Unmarshal([]byte(s), &d); err != nil {
		return domainXML{}, fmt.Errorf("parse domain XML: %w", err)
	}
	return d, nil
}

// memoryBytes converts libvirt's memory element to bytes.
func (d domainXML) memoryBytes() int64 {
	switch strings.ToLower(d.Memory.Unit) {
	case "b", "bytes":
		return d.Memory.Value
	case "", "k", "kib":
		return d.Memory.Value << 10
	case "m", "mib":
		return d.Memory.Value << 20
	case "g", "gib":
		return d.Memory.Value << 30
	case "kb":
		return d.Memory.Value * 1000
	case "mb":
		return d.Memory.Value * 1000 * 1000
	case "gb":
		return d.Memory.Value * 1000 * 1000 * 1000
	}
	return d.Memory.Value << 10
}
