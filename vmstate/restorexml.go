package vmstate

import (
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"

	"libvirt.org/go/libvirtxml"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/network"
)

// ramID is the id of the memory backend kvbox puts a box's RAM in.
const ramID = domain.RAMBackendID

// RestoreSpec is what makes the domain of a box that restores a saved
// state (a clone of a snapshot, a box waking from its suspend) different
// from the domain that saved it.
type RestoreSpec struct {
	Name string
	Meta domain.Meta // the box's kvbox metadata (MAC, IP, Dir, ...)
	Disk string      // the box's qcow2 disk
	// MemPath is the file the box maps its RAM from (privately,
	// read-only), at MemOffset: the state file, written with mapped-ram.
	MemPath   string
	MemOffset int64
	// MemBytes is the RAM size the snapshot recorded; 0 trusts the size
	// in the source's memory backend.
	MemBytes int64
	// UUID is empty for the first define (libvirt picks one).
	UUID string
	// DACLabel, when set, is this host's static DAC label for QEMU
	// (domain.Host.DACLabel): the clone runs as that user and libvirt
	// chowns nothing, neither the snapshot's files nor its base image.
	DACLabel string
	// Boot asks for the clone's definition for its next cold boot
	// instead: anonymous RAM (domain.RAMArgs, as any box), no -incoming.
	// Clone redefines the running clone with it, so `kvbox stop` +
	// `kvbox start` boots instead of waiting for a migration stream that
	// never comes.
	Boot bool
}

// RestoreXML derives the domain XML of a box that restores a saved state
// (a clone, or a box waking from its suspend, which keeps its own name,
// UUID and metadata) from the saved domain XML by a round trip through
// libvirtxml: machine type, CPU model, devices and
// their addresses stay exactly the source's (the migration stream needs
// them), while everything that names the source or only exists at runtime
// goes: name, uuid, id, hwuuid, generation ID (an empty <genid/> makes
// libvirt pick a fresh one, which the guest reseeds its RNG from), security
// labels, device aliases libvirt assigned, the interface's tap name, pty
// paths, the disk's backing chain. Disk, agent sockets and console log move
// to the clone's folder, the MAC to the clone's, and the RAM backend maps
// the snapshot's RAM privately and read-only, with -incoming defer
// so QEMU waits for the state stream.
func RestoreXML(src string, s RestoreSpec) (string, error) {
	var d libvirtxml.Domain
	if err := d.Unmarshal(src); err != nil {
		return "", fmt.Errorf("parse the snapshot's domain XML: %w", err)
	}
	if s.Name == "" || s.Meta.Dir == "" || s.Disk == "" || s.MemPath == "" {
		return "", base.Errorf(base.Invalid, "clone XML: name, dir, disk and memory path are required")
	}
	d.ID = nil
	d.Name = s.Name
	d.UUID = s.UUID
	d.HWUUID = ""
	d.GenID = &libvirtxml.DomainGenID{}
	d.SecLabel = nil
	if s.DACLabel != "" {
		d.SecLabel = []libvirtxml.DomainSecLabel{{Type: "static", Model: "dac", Relabel: "no", Label: s.DACLabel}}
	}
	md, err := replaceMeta(d.Metadata, s.Meta)
	if err != nil {
		return "", err
	}
	d.Metadata = md
	if d.Devices == nil {
		return "", base.Errorf(base.Invalid, "the snapshot's domain XML has no devices")
	}
	if err := cloneDisk(d.Devices, s.Disk); err != nil {
		return "", err
	}
	if err := cloneInterface(d.Devices, s.Meta); err != nil {
		return "", err
	}
	if err := cloneChardevs(d.Devices, s.Meta.Dir); err != nil {
		return "", err
	}
	args, err := cloneQemuArgs(d.QEMUCommandline, s)
	if err != nil {
		return "", err
	}
	d.QEMUCommandline.Args = args
	d.QEMUCapabilities = withoutCPUUnavailableFeatures(d.QEMUCapabilities)
	offerFreePageHints(d.QEMUOverride, !s.Boot)
	stripRuntime(reflect.ValueOf(&d))
	out, err := d.Marshal()
	if err != nil {
		return "", fmt.Errorf("render the clone's domain XML: %w", err)
	}
	return out, nil
}

// offerFreePageHints has a clone's balloon offer free page hints (on
// true) where the snapshot's has kvbox's override of it
// (templates/box.xml), and a clone's next cold boot not (on false). A box
// booted from an image does not offer them: while a migration runs, a
// guest that takes them holds its free memory, and gives it back only
// once the migration is over, so the snapshot's state has it held, and
// every clone gave it back on its first run, writing the kernel's page
// structs of all of it: more host memory per clone and a slower identify
// (docs/design.md#free-page-hints). Anonymous RAM needs no hints; a clone's RAM, mapped
// from the snapshot's state, does, when the clone is snapshotted
// (a gated copy, see Save).
func offerFreePageHints(o *libvirtxml.DomainQEMUOverride, on bool) {
	if o == nil {
		return
	}
	for i := range o.Devices {
		if o.Devices[i].Alias != domain.BalloonAlias {
			continue
		}
		props := o.Devices[i].Frontend.Properties
		for j := range props {
			if props[j].Name == "free-page-hint" {
				props[j].Type, props[j].Value = "bool", strconv.FormatBool(on)
				return
			}
		}
	}
}

// fastCPUCap is the QEMU capability a clone hides from libvirt. With it,
// libvirt 11 reads the started guest's CPU with one qom-get per x86 feature
// (qemuMonitorGetGuestCPU, hundreds of QMP round trips: docs/design.md#cpu-features); without
// it libvirt takes its older x86 path (qemuMonitorGetGuestCPUx86: the
// feature-words and filtered-features properties, two qom-gets). Both feed
// qemuProcessUpdateGuestCPU the same enabled/disabled feature sets on x86,
// so the check that a required feature is present is kept. The cost:
// libvirt marks the domain tainted (custom-hypervisor-feature), and on KVM a
// host-model CPU's disabled features are read from QEMU's filtered-features
// words instead of by name, which misses features QEMU cannot express as a
// CPUID bit (MSR-based ones). A clone's CPU is the snapshot's, already
// checked when its source booted, and the migration stream would fail on a
// mismatch anyway.
const fastCPUCap = "cpu-unavailable-features"

// withoutCPUUnavailableFeatures adds <qemu:del capability='...'/> for
// fastCPUCap to caps, keeping whatever else the source asked for.
func withoutCPUUnavailableFeatures(caps *libvirtxml.DomainQEMUCapabilities) *libvirtxml.DomainQEMUCapabilities {
	if caps == nil {
		caps = &libvirtxml.DomainQEMUCapabilities{}
	}
	var add []libvirtxml.DomainQEMUCapabilitiesEntry
	for _, e := range caps.Add {
		if e.Name != fastCPUCap {
			add = append(add, e)
		}
	}
	caps.Add = add
	for _, e := range caps.Del {
		if e.Name == fastCPUCap {
			return caps
		}
	}
	caps.Del = append(caps.Del, libvirtxml.DomainQEMUCapabilitiesEntry{Name: fastCPUCap})
	return caps
}

// replaceMeta swaps the kvbox element of <metadata> for m and keeps any
// other application's metadata as it was, byte for byte.
func replaceMeta(old *libvirtxml.DomainMetadata, m domain.Meta) (*libvirtxml.DomainMetadata, error) {
	box, err := domain.MarshalMeta(m)
	if err != nil {
		return nil, err
	}
	var keep string
	if old != nil {
		keep, err = dropElements(old.XML, domain.MetadataNS)
		if err != nil {
			return nil, fmt.Errorf("the snapshot's domain metadata: %w", err)
		}
	}
	keep = strings.TrimSpace(keep)
	if keep != "" {
		keep = "\n    " + keep
	}
	return &libvirtxml.DomainMetadata{XML: "\n" + box + keep + "\n  "}, nil
}

// dropElements removes the top-level elements in namespace ns from an XML
// fragment, cutting them out of the original bytes.
func dropElements(frag, ns string) (string, error) {
	dec := xml.NewDecoder(strings.NewReader(frag))
	var out strings.Builder
	copied, depth := int64(0), 0
	var cutStart int64 = -1
	for {
		before := dec.InputOffset()
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", err
		}
		switch t := tok.(type) {
		case xml.StartElement:
			if depth == 0 && t.Name.Space == ns {
				out.WriteString(frag[copied:before])
				cutStart = before
			}
			depth++
		case xml.EndElement:
			depth--
			if depth == 0 && cutStart >= 0 {
				copied = dec.InputOffset()
				cutStart = -1
			}
		}
	}
	out.WriteString(frag[copied:])
	return out.String(), nil
}

// cloneDisk points the first file disk at the clone's overlay.
func cloneDisk(devs *libvirtxml.DomainDeviceList, disk string) error {
	for i := range devs.Disks {
		dk := &devs.Disks[i]
		if dk.Device != "" && dk.Device != "disk" {
			continue
		}
		if dk.Source == nil || dk.Source.File == nil {
			continue
		}
		dk.Source.File.File = disk
		dk.Source.File.SecLabel = nil
		dk.Source.Index = 0
		dk.BackingStore = nil
		if dk.Driver == nil {
			dk.Driver = &libvirtxml.DomainDiskDriver{Name: "qemu"}
		}
		dk.Driver.Type = "qcow2"
		return nil
	}
	return base.Errorf(base.Invalid, "the snapshot's domain XML has no file disk")
}

// cloneInterface gives the box's interface the clone's MAC, bridge and tap
// (named after its MAC). kvbox's port filter pins that tap to the clone's
// own MAC and address, never the source's: a clone whose agent lies and
// keeps the source's identity gets not one frame through.
func cloneInterface(devs *libvirtxml.DomainDeviceList, m domain.Meta) error {
	if len(devs.Interfaces) == 0 && m.Bridge == "" && m.MAC == "" {
		return nil // a box without network (--network none)
	}
	if m.MAC == "" {
		return base.Errorf(base.Invalid, "clone XML: the clone has no MAC")
	}
	if len(devs.Interfaces) != 1 {
		return base.Errorf(base.Invalid, "the snapshot's domain has %d network interfaces; a kvbox box has one", len(devs.Interfaces))
	}
	ifc := &devs.Interfaces[0]
	ifc.MAC = &libvirtxml.DomainInterfaceMAC{Address: m.MAC}
	ifc.Target = &libvirtxml.DomainInterfaceTarget{Dev: network.TapName(m.MAC)}
	if m.Bridge != "" {
		ifc.Source = &libvirtxml.DomainInterfaceSource{Bridge: &libvirtxml.DomainInterfaceSourceBridge{Bridge: m.Bridge}}
	}
	if m.IP == "" {
		return base.Errorf(base.Invalid, "clone XML: the clone has no address for its port filter")
	}
	// kvbox's port filter holds the clone's tap with its own MAC and
	// address; a libvirt nwfilter an operator's template put on the
	// source would hold the source's address: dropped.
	ifc.FilterRef = nil
	// An isolated port, but in a box group, where boxes reach each other.
	ifc.PortOptions = &libvirtxml.DomainInterfacePortOptions{Isolated: "yes"}
	if m.Group != "" {
		ifc.PortOptions = nil
	}
	return nil
}

// cloneChardevs moves agent sockets and console logs into dir. Agent
// channels keep their names and order (the guest's ports are in the
// migrated device state); their sockets get the box layout's paths.
func cloneChardevs(devs *libvirtxml.DomainDeviceList, dir string) error {
	sockets := map[string]string{}
	for _, p := range domain.AgentSockets(dir) {
		sockets[p.Name] = p.Path
	}
	seen := 0
	for i := range devs.Channels {
		ch := &devs.Channels[i]
		if ch.Source == nil || ch.Source.UNIX == nil || ch.Target == nil || ch.Target.VirtIO == nil {
			continue
		}
		path, ok := sockets[ch.Target.VirtIO.Name]
		if !ok {
			// Some other unix channel (e.g. qemu-guest-agent): a socket
			// in the source's folder would collide, so move it along.
			path = dir + "/" + sanitize(ch.Target.VirtIO.Name) + ".sock"
		} else {
			seen++
		}
		ch.Source.UNIX.Path = path
		ch.Target.VirtIO.State = "" // connected or not: runtime only
		ch.Source.UNIX.SecLabel = nil
		ch.Log = cloneLog(ch.Log, dir)
	}
	if seen == 0 && domain.Transport() != "vsock" {
		return base.Errorf(base.Invalid, "the snapshot's domain XML has no kvbox agent channel")
	}
	// The source's vsock CID is taken while it runs: the clone gets its
	// own (the agent listens on any CID, so the guest needs no change).
	if devs.VSock != nil {
		devs.VSock.CID = &libvirtxml.DomainVSockCID{Auto: "yes"}
	}
	for i := range devs.Serials {
		clearPty(devs.Serials[i].Source)
		devs.Serials[i].Log = cloneLog(devs.Serials[i].Log, dir)
	}
	for i := range devs.Consoles {
		clearPty(devs.Consoles[i].Source)
		devs.Consoles[i].TTY = ""
		devs.Consoles[i].Log = cloneLog(devs.Consoles[i].Log, dir)
	}
	return nil
}

func clearPty(s *libvirtxml.DomainChardevSource) {
	if s != nil && s.Pty != nil {
		s.Pty.Path = ""
		s.Pty.SecLabel = nil
	}
}

func cloneLog(l *libvirtxml.DomainChardevLog, dir string) *libvirtxml.DomainChardevLog {
	if l == nil {
		return nil
	}
	return &libvirtxml.DomainChardevLog{File: dir + "/console.log", Append: l.Append}
}

func sanitize(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '/' || r == 0 {
			return '_'
		}
		return r
	}, s)
}

// cloneQemuArgs replaces the source's RAM backend (anonymous) with a private, read-only mapping of the snapshot's memory and
// adds -incoming defer. Other pass-through arguments are kept.
func cloneQemuArgs(cl *libvirtxml.DomainQEMUCommandline, s RestoreSpec) ([]libvirtxml.DomainQEMUCommandlineArg, error) {
	if cl == nil {
		return nil, base.Errorf(base.Invalid, "the snapshot's domain XML has no qemu:commandline with kvbox's RAM backend")
	}
	in := make([]string, len(cl.Args))
	for i, a := range cl.Args {
		in[i] = a.Value
	}
	var out []string
	size := int64(-1)
	machine := false
	for i := 0; i < len(in); i++ {
		a := in[i]
		next := ""
		if i+1 < len(in) {
			next = in[i+1]
		}
		switch {
		case a == "-object" && hasOpt(next, "id", ramID):
			v, ok := optValue(next, "size")
			n, err := strconv.ParseInt(v, 10, 64)
			if !ok || err != nil || n <= 0 {
				return nil, base.Errorf(base.Invalid, "kvbox's RAM backend in the snapshot's domain XML has no size in bytes: %q", next)
			}
			size = n
			i++
		case a == "-incoming":
			i++ // the clone's own comes below
		case a == "-machine" && next == "memory-backend="+ramID:
			machine = true
			i++
		default:
			out = append(out, a)
		}
	}
	if size < 0 || !machine {
		return nil, base.Errorf(base.Invalid, "the snapshot's domain XML lacks kvbox's RAM backend (-object memory-backend-ram,id=%s and -machine memory-backend=%s)", ramID, ramID)
	}
	if s.MemBytes > 0 && s.MemBytes != size {
		return nil, base.Errorf(base.Invalid, "the snapshot records %d bytes of RAM but its domain XML maps %d", s.MemBytes, size)
	}
	switch {
	case s.Boot:
		out = append(out, domain.RAMArgs(size)...)
	default:
		obj := fmt.Sprintf("memory-backend-file,id=%s,size=%d,mem-path=%s,share=off,readonly=on,rom=off", ramID, size, domain.QemuOptEscape(s.MemPath))
		if s.MemOffset != 0 {
			obj += fmt.Sprintf(",offset=%d", s.MemOffset)
		}
		out = append(out, "-object", obj, "-machine", "memory-backend="+ramID, "-incoming", "defer")
	}
	args := make([]libvirtxml.DomainQEMUCommandlineArg, len(out))
	for i, a := range out {
		args[i] = libvirtxml.DomainQEMUCommandlineArg{Value: a}
	}
	return args, nil
}

func optValue(opts, key string) (string, bool) {
	for _, p := range domain.SplitQemuOpts(opts) {
		if k, v, ok := strings.Cut(p, "="); ok && k == key {
			return v, true
		}
	}
	return "", false
}

func hasOpt(opts, key, want string) bool {
	v, ok := optValue(opts, key)
	return ok && v == want
}

var aliasType = reflect.TypeOf(&libvirtxml.DomainAlias{})

// stripRuntime walks the domain and drops what only a running domain has:
// device aliases libvirt assigned (user aliases, "ua-...", stay) and
// dynamic per-device security labels.
func stripRuntime(v reflect.Value) {
	switch v.Kind() {
	case reflect.Pointer, reflect.Interface:
		if v.IsNil() {
			return
		}
		if v.Type() == aliasType {
			return // handled by the parent, which can set it to nil
		}
		stripRuntime(v.Elem())
	case reflect.Struct:
		for i := 0; i < v.NumField(); i++ {
			f := v.Field(i)
			if !f.CanSet() {
				continue
			}
			if f.Type() == aliasType {
				if !f.IsNil() && !strings.HasPrefix(f.Interface().(*libvirtxml.DomainAlias).Name, "ua-") {
					f.Set(reflect.Zero(f.Type()))
				}
				continue
			}
			if f.Type() == reflect.TypeOf([]libvirtxml.DomainDeviceSecLabel(nil)) {
				f.Set(reflect.Zero(f.Type()))
				continue
			}
			stripRuntime(f)
		}
	case reflect.Slice, reflect.Array:
		for i := 0; i < v.Len(); i++ {
			stripRuntime(v.Index(i))
		}
	}
}
