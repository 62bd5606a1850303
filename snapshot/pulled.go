package snapshot

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"

	"libvirt.org/go/libvirtxml"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/templates"
)

// A snapshot pulled from a registry is untrusted input: whoever pushed it
// chose every byte of its domain XML. PulledXML builds the domain XML its
// clones derive from out of kvbox's own template (templates/box.xml, never
// an operator's), and takes from the pushed XML only what a snapshot may
// carry: the machine type, the CPU model and its features, the vCPU count,
// the memory size, and the device addresses and the defaults libvirt added
// to kvbox's fixed device set (controllers, a PS/2 mouse and keyboard, an
// audio backend of type none, a watchdog), since the migration stream needs
// the same devices at the same addresses. Every path in it is this
// host's, chosen by kvbox.
//
// What the pushed XML carries beyond that is refused when it would change
// what the guest or its QEMU can reach on this host (a device, a host path,
// a QEMU argument or property, another network), and otherwise not carried
// (harmless: names, uuids, other applications' metadata, labels, tuning,
// lifecycle actions); the kvbox metadata's box group is not carried either
// (a pulled snapshot's clones join no group of this host), and PulledXML
// says so in a note.

// PulledSpec is what PulledXML builds a pulled snapshot's domain XML from:
// where its files are on this host, and what the pull checked.
type PulledSpec struct {
	Dir       string // the snapshot's folder here, once installed
	Image     string // its base image's name here
	DiskBytes int64  // the disk size its snapshot.json records
	// MemoryBytes and CPUs are what its snapshot.json records; the domain
	// XML must say the same.
	MemoryBytes int64
	CPUs        int
	// Kernel and Initrd are the image version's files here ("" when it has
	// none); SrcKernel and SrcInitrd the same files on the pushing host,
	// the only ones the pushed XML may name.
	Kernel, Initrd       string
	SrcKernel, SrcInitrd string
	// Emulator is the <emulator> this host gives kvbox's boxes
	// (domain.Host.Emulator; "" for libvirt's default). SrcWrapper is
	// kvbox's QEMU wrapper on the pushing host (its state dir's libexec).
	Emulator   string
	SrcWrapper string
	// Compat is what the pull checked this host against: the XML must
	// ask for the same domain type, machine and CPU.
	Compat Compat
}

// maxCPUs and the memory bounds are those of kvbox new (domain.Spec).
const (
	maxPulledCPUs      = 256
	minPulledMemory    = 64 << 20
	maxPulledMemory    = 1 << 40
	maxPulledCPUFeats  = 512
	maxPulledDevices   = 64
	maxPulledCmdline   = 4096
	pulledBridgeHolder = "kvbox0" // a clone names its own bridge (cloneInterface)
)

var (
	machineRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,63}$`)
	cpuNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)
	agentRE   = regexp.MustCompile(`^org\.kvbox\.agent\.[0-9]{1,2}$`)
	// a QEMU binary a snapshot may have named (it is replaced by this
	// host's choice; anything else is refused as a crafted artifact)
	qemuPathRE = regexp.MustCompile(`^/usr(/local)?/(bin|sbin|libexec)/(qemu-system-x86_64|qemu-kvm)$`)
)

// refusedf is one line saying what of the pushed domain XML kvbox refuses.
func refusedf(format string, a ...any) error {
	return base.Errorf(base.Invalid, "the snapshot's domain XML %s", fmt.Sprintf(format, a...))
}

// PulledXML returns the domain XML of a pulled snapshot (see above), and
// notes for the user about what was not carried that they may expect.
func PulledXML(src string, p PulledSpec) (string, []string, error) {
	var d libvirtxml.Domain
	if err := d.Unmarshal(src); err != nil {
		return "", nil, refusedf("does not parse (%v)", oneLine(err.Error()))
	}
	c, err := checkPushed(&d, p)
	if err != nil {
		return "", nil, err
	}
	x, err := renderPulled(&d, p, c)
	if err != nil {
		return "", nil, err
	}
	return x, c.notes, nil
}

// checkedDomain is what checkPushed keeps of a pushed domain XML for
// renderPulled: each part as kvbox carries it.
type checkedDomain struct {
	notes        []string
	meta         domain.Meta
	cpu          *libvirtxml.DomainCPU
	mem          int64
	cur          *libvirtxml.DomainCurrentMemory
	devs         pulledDevices
	ramArgs      []string
	keepOverride bool
}

// checkPushed checks each part of the pushed domain XML d against its
// snapshot.json (p) and this host, and refuses the first that kvbox would
// not have written.
func checkPushed(d *libvirtxml.Domain, p PulledSpec) (checkedDomain, error) {
	var c checkedDomain
	if err := checkTop(d); err != nil {
		return c, err
	}
	var err error
	if c.meta, err = pulledMeta(d.Metadata); err != nil {
		return c, err
	}
	if c.meta.Group != "" {
		c.notes = append(c.notes, fmt.Sprintf("the snapshot's box was in box group %q of the host that pushed it; its clones here join no group", printable(c.meta.Group)))
	}
	if d.Type != "qemu" && d.Type != "kvm" || d.Type != p.Compat.DomainType {
		return c, refusedf("asks for domain type %q, its compatibility record for %q", printable(d.Type), printable(p.Compat.DomainType))
	}
	if err := checkOS(d.OS, p); err != nil {
		return c, err
	}
	if c.cpu, err = pulledCPU(d.CPU, p.Compat); err != nil {
		return c, err
	}
	if c.mem, c.cur, err = pulledMemory(d, p.MemoryBytes); err != nil {
		return c, err
	}
	if d.VCPU == nil || int(d.VCPU.Value) != p.CPUs || p.CPUs < 1 || p.CPUs > maxPulledCPUs || d.VCPU.Current != 0 && int(d.VCPU.Current) != p.CPUs {
		return c, refusedf("has a vCPU count that is not the %d its snapshot.json records (1 to %d)", p.CPUs, maxPulledCPUs)
	}
	if err := checkFeatures(d.Features); err != nil {
		return c, err
	}
	if d.Devices == nil {
		return c, refusedf("has no devices")
	}
	if c.devs, err = checkDevices(d.Devices, p); err != nil {
		return c, err
	}
	if c.ramArgs, err = checkQemuArgs(d.QEMUCommandline, c.mem); err != nil {
		return c, err
	}
	if c.keepOverride, err = checkOverride(d.QEMUOverride); err != nil {
		return c, err
	}
	if t := c.meta.Transport; t != "" && t != "vsock" && t != "virtio-serial" {
		return c, refusedf("names the agent transport %q (vsock or virtio-serial)", printable(t))
	}
	return c, nil
}

// renderPulled renders kvbox's own template for the pulled snapshot, with
// what checkPushed kept of the pushed domain XML d in it.
func renderPulled(d *libvirtxml.Domain, p PulledSpec, c checkedDomain) (string, error) {
	devs := c.devs
	md, err := domain.MarshalMeta(domain.Meta{
		Image: p.Image, MAC: devs.mac, Bridge: bridgeIf(devs.mac), Dir: p.Dir, DiskBytes: p.DiskBytes,
		Transport: c.meta.Transport, Created: c.meta.Created,
	})
	if err != nil {
		return "", err
	}
	var cmdline string
	if d.OS.Kernel != "" {
		cmdline = d.OS.Cmdline
	}
	out, err := domain.Render(templates.Box, domain.TemplateData{
		Type: d.Type, Emulator: p.Emulator, Name: "pulled", Metadata: md, MemoryBytes: c.mem, CPUs: p.CPUs,
		Kernel: kernelIf(d.OS.Kernel, p.Kernel), Initrd: kernelIf(d.OS.Initrd, p.Initrd), Cmdline: cmdline,
		Disk: p.Dir + "/" + DiskFile, ConsoleLog: p.Dir + "/console.log",
		// The NIC's bridge, tap and address are placeholders: a clone names its own (cloneInterface).
		Bridge: bridgeIf(devs.mac), MAC: devs.mac, Tap: tapIf(devs.mac), IP: ipIf(devs.mac),
		AgentPorts: devs.agents, Vsock: devs.vsock, QemuArgs: c.ramArgs,
	})
	if err != nil {
		return "", err
	}
	var t libvirtxml.Domain
	if err := t.Unmarshal(out); err != nil {
		return "", fmt.Errorf("kvbox's template for a pulled snapshot: %w", err)
	}
	t.OS.Type.Machine = d.OS.Type.Machine
	t.CPU = c.cpu
	t.CurrentMemory = c.cur
	t.Features = pulledFeatures(d.Features)
	if !devs.balloon || !c.keepOverride || d.IOThreads == 0 {
		t.QEMUOverride = nil
	}
	if d.IOThreads == 0 {
		t.IOThreads = 0
	}
	if err := graftDevices(t.Devices, devs); err != nil {
		return "", err
	}
	x, err := t.Marshal()
	if err != nil {
		return "", fmt.Errorf("render a pulled snapshot's domain XML: %w", err)
	}
	return x, nil
}

func bridgeIf(mac string) string {
	if mac == "" {
		return ""
	}
	return pulledBridgeHolder
}

func tapIf(mac string) string {
	if mac == "" {
		return ""
	}
	return network.TapName(mac)
}

func ipIf(mac string) string {
	if mac == "" {
		return ""
	}
	return "0.0.0.0"
}

func kernelIf(src, here string) string {
	if src == "" {
		return ""
	}
	return here
}

// nonZero names (by XML element) the fields of the struct v points to
// that are set and not in allowed.
func nonZero(v any, allowed ...string) []string {
	rv := reflect.ValueOf(v).Elem()
	ok := map[string]bool{"XMLName": true}
	for _, a := range allowed {
		ok[a] = true
	}
	var out []string
	for i := 0; i < rv.NumField(); i++ {
		f := rv.Type().Field(i)
		if ok[f.Name] || rv.Field(i).IsZero() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("xml"), ",")
		if name == "" || name == "-" {
			name = strings.ToLower(f.Name)
		}
		if i := strings.LastIndex(name, " "); i >= 0 {
			name = name[i+1:]
		}
		out = append(out, name)
	}
	return out
}

// checkTop refuses the top-level elements that give the guest or QEMU a
// reach kvbox's boxes do not have; the others it does not check are not
// carried (see PulledXML).
func checkTop(d *libvirtxml.Domain) error {
	// Allowed, checked below: Type, Metadata, Memory, CurrentMemory,
	// VCPU, IOThreads, OS, Features, CPU, Devices, QEMUCommandline,
	// QEMUOverride. Harmless, not carried: the rest of the first group.
	extra := nonZero(d,
		"Type", "Metadata", "Memory", "CurrentMemory", "VCPU", "IOThreads", "OS", "Features", "CPU", "Devices",
		"QEMUCommandline", "QEMUOverride",
		"ID", "Name", "UUID", "HWUUID", "GenID", "Title", "Description", "BlockIOTune", "MemoryTune",
		"IOThreadIDs", "DefaultIOThread", "CPUTune", "NUMATune", "Resource", "ThrottleGroups", "Clock",
		"OnPoweroff", "OnReboot", "OnCrash", "OnLockFailure", "PM", "Perf", "SecLabel", "KeyWrap",
		"QEMUCapabilities", "QEMUDeprecation")
	if len(extra) > 0 {
		return refusedf("has <%s> (a pulled snapshot gets kvbox's own domain: machine, CPU, sizes and its fixed devices)", extra[0])
	}
	return nil
}

// pulledMeta reads the kvbox metadata of the pushed XML, if any.
func pulledMeta(md *libvirtxml.DomainMetadata) (domain.Meta, error) {
	if md == nil {
		return domain.Meta{}, nil
	}
	m, ok, err := domain.MetaOfXML("<domain><metadata>" + md.XML + "</metadata></domain>")
	if err != nil {
		return domain.Meta{}, refusedf("has metadata that does not parse (%v)", oneLine(err.Error()))
	}
	if !ok {
		return domain.Meta{}, nil
	}
	return m, nil
}

// checkOS: x86_64 hvm on the machine the compatibility record names,
// booting the pulled image's kernel (or its disk), and nothing else: a
// firmware, loader, NVRAM, device tree or ACPI table is a host file.
func checkOS(o *libvirtxml.DomainOS, p PulledSpec) error {
	if o == nil || o.Type == nil {
		return refusedf("has no <os><type>")
	}
	if extra := nonZero(o, "Type", "Kernel", "Initrd", "Cmdline", "BootDevices", "BootMenu", "BIOS"); len(extra) > 0 {
		return refusedf("has <os><%s> (a host file or a host table; a pulled snapshot boots its image's kernel or disk)", extra[0])
	}
	if o.Type.Arch != "x86_64" || o.Type.Type != "hvm" {
		return refusedf("asks for %q on %q (kvbox runs x86_64 hvm)", printable(o.Type.Type), printable(o.Type.Arch))
	}
	if !machineRE.MatchString(o.Type.Machine) || o.Type.Machine != p.Compat.Machine {
		return refusedf("asks for machine %q, its compatibility record for %q", printable(o.Type.Machine), printable(p.Compat.Machine))
	}
	for _, f := range []struct{ what, got, want, here string }{
		{"kernel", o.Kernel, p.SrcKernel, p.Kernel},
		{"initrd", o.Initrd, p.SrcInitrd, p.Initrd},
	} {
		if f.got != "" && (f.got != f.want || f.want == "" || f.here == "") {
			return refusedf("boots the %s %q, not its base image's", f.what, printable(f.got))
		}
	}
	if o.Initrd != "" && o.Kernel == "" {
		return refusedf("has an initrd without a kernel")
	}
	if len(o.Cmdline) > maxPulledCmdline || strings.IndexFunc(o.Cmdline, func(r rune) bool { return r < 0x20 || r == 0x7f }) >= 0 {
		return refusedf("has a kernel command line longer than %d bytes or with control characters", maxPulledCmdline)
	}
	return nil
}

// pulledCPU is the pushed <cpu>, checked: its mode and model are what the
// compatibility record the pull checked names; its features, topology,
// cache and address width are copied, nothing else (NUMA cells, which can
// name host memory, are refused).
func pulledCPU(c *libvirtxml.DomainCPU, compat Compat) (*libvirtxml.DomainCPU, error) {
	if c == nil {
		if compat.CPUMode != "" || compat.CPUModel != "" {
			return nil, refusedf("has no <cpu>, its compatibility record names one")
		}
		return nil, nil
	}
	if c.Numa != nil {
		return nil, refusedf("has <cpu><numa> (NUMA cells can name host memory)")
	}
	oneOf := func(v string, set ...string) bool {
		for _, s := range set {
			if v == s {
				return true
			}
		}
		return false
	}
	if !oneOf(c.Mode, "", "custom", "host-model", "host-passthrough", "maximum") || !oneOf(c.Match, "", "exact", "minimum", "strict") ||
		!oneOf(c.Check, "", "none", "partial", "full") || !oneOf(c.Migratable, "", "on", "off") {
		return nil, refusedf("has a <cpu> mode, match, check or migratable value kvbox does not know")
	}
	out := &libvirtxml.DomainCPU{Mode: c.Mode, Match: c.Match, Check: c.Check, Migratable: c.Migratable}
	model := ""
	if c.Model != nil {
		model = c.Model.Value
		if model != "" && !cpuNameRE.MatchString(model) || !oneOf(c.Model.Fallback, "", "allow", "forbid") || c.Model.VendorID != "" && !cpuNameRE.MatchString(c.Model.VendorID) {
			return nil, refusedf("has a CPU model %q kvbox does not take", printable(model))
		}
		out.Model = &libvirtxml.DomainCPUModel{Value: model, Fallback: c.Model.Fallback, VendorID: c.Model.VendorID}
	}
	if c.Mode != compat.CPUMode || model != compat.CPUModel {
		return nil, refusedf("asks for CPU %s %s, its compatibility record for %s %s", printable(c.Mode), printable(model), printable(compat.CPUMode), printable(compat.CPUModel))
	}
	if c.Vendor != "" {
		if !cpuNameRE.MatchString(c.Vendor) {
			return nil, refusedf("has a CPU vendor %q kvbox does not take", printable(c.Vendor))
		}
		out.Vendor = c.Vendor
	}
	if len(c.Features) > maxPulledCPUFeats {
		return nil, refusedf("has %d CPU features (at most %d)", len(c.Features), maxPulledCPUFeats)
	}
	for _, f := range c.Features {
		if !cpuNameRE.MatchString(f.Name) || !oneOf(f.Policy, "", "force", "require", "optional", "disable", "forbid") {
			return nil, refusedf("has a CPU feature %q (%q) kvbox does not take", printable(f.Name), printable(f.Policy))
		}
		out.Features = append(out.Features, libvirtxml.DomainCPUFeature{Name: f.Name, Policy: f.Policy})
	}
	if t := c.Topology; t != nil {
		for _, n := range []int{t.Sockets, t.Dies, t.Clusters, t.Cores, t.Threads} {
			if n < 0 || n > maxPulledCPUs {
				return nil, refusedf("has a CPU topology out of range")
			}
		}
		out.Topology = &libvirtxml.DomainCPUTopology{Sockets: t.Sockets, Dies: t.Dies, Clusters: t.Clusters, Cores: t.Cores, Threads: t.Threads}
	}
	if ca := c.Cache; ca != nil {
		if !oneOf(ca.Mode, "emulate", "passthrough", "disable") || ca.Level > 3 {
			return nil, refusedf("has a CPU cache mode kvbox does not take")
		}
		out.Cache = &libvirtxml.DomainCPUCache{Level: ca.Level, Mode: ca.Mode}
	}
	if a := c.MaxPhysAddr; a != nil {
		if !oneOf(a.Mode, "emulate", "passthrough") || a.Bits > 64 || a.Limit > 64 {
			return nil, refusedf("has a CPU address width kvbox does not take")
		}
		out.MaxPhysAddr = &libvirtxml.DomainCPUMaxPhysAddr{Mode: a.Mode, Bits: a.Bits, Limit: a.Limit}
	}
	return out, nil
}

// memBytes converts a libvirt memory amount to bytes; false on a unit
// libvirt does not know or an overflow.
func memBytes(v uint, unit string) (int64, bool) {
	mul := map[string]uint64{"b": 1, "bytes": 1, "k": 1 << 10, "kib": 1 << 10, "": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
		"g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}[strings.ToLower(unit)]
	if mul == 0 || uint64(v) > (1<<62)/mul {
		return 0, false
	}
	return int64(uint64(v) * mul), true
}

// pulledMemory: the memory size is the snapshot.json's; the balloon's
// target (currentMemory) is kept if it is not more.
func pulledMemory(d *libvirtxml.Domain, want int64) (int64, *libvirtxml.DomainCurrentMemory, error) {
	if d.Memory == nil || d.Memory.DumpCore != "" {
		return 0, nil, refusedf("has no plain <memory>")
	}
	n, ok := memBytes(d.Memory.Value, d.Memory.Unit)
	if !ok || n != want || n < minPulledMemory || n > maxPulledMemory || n%(2<<20) != 0 {
		return 0, nil, refusedf("has a memory size that is not the %d bytes its snapshot.json records (64 MB to 1 TiB, a multiple of 2 MB)", want)
	}
	if d.CurrentMemory == nil {
		return n, nil, nil
	}
	c, ok := memBytes(d.CurrentMemory.Value, d.CurrentMemory.Unit)
	if !ok || c > n || c <= 0 || c%1024 != 0 {
		return 0, nil, refusedf("has a current memory size above its memory size")
	}
	return n, &libvirtxml.DomainCurrentMemory{Value: uint(c >> 10), Unit: "KiB"}, nil
}

// checkFeatures: ACPI, APIC and PAE, which kvbox's template and libvirt's
// defaults give a box; any other machine feature is refused.
func checkFeatures(f *libvirtxml.DomainFeatureList) error {
	if f == nil {
		return nil
	}
	if extra := nonZero(f, "ACPI", "APIC", "PAE"); len(extra) > 0 {
		return refusedf("has the machine feature <%s> (kvbox's boxes have acpi, apic and pae only)", extra[0])
	}
	if f.APIC != nil && f.APIC.EOI != "" && f.APIC.EOI != "on" && f.APIC.EOI != "off" {
		return refusedf("has an apic eoi value kvbox does not know")
	}
	return nil
}

func pulledFeatures(f *libvirtxml.DomainFeatureList) *libvirtxml.DomainFeatureList {
	if f == nil {
		return nil
	}
	out := &libvirtxml.DomainFeatureList{}
	if f.ACPI != nil {
		out.ACPI = &libvirtxml.DomainFeature{}
	}
	if f.PAE != nil {
		out.PAE = &libvirtxml.DomainFeature{}
	}
	if f.APIC != nil {
		out.APIC = &libvirtxml.DomainFeatureAPIC{EOI: f.APIC.EOI}
	}
	return out
}

// pulledDevices is what checkDevices took from the pushed devices.
type pulledDevices struct {
	mac     string // the NIC's (none: no network)
	agents  []domain.AgentPort
	vsock   bool
	balloon bool // a virtio balloon (else none)

	diskAddr, nicAddr, rngAddr, balloonAddr, vsockAddr *libvirtxml.DomainAddress
	agentAddr                                          map[string]*libvirtxml.DomainAddress
	controllers                                        []libvirtxml.DomainController
	inputs                                             []libvirtxml.DomainInput
	audios                                             []libvirtxml.DomainAudio
	watchdogs                                          []libvirtxml.DomainWatchdog
	rngDevice                                          string
}

// checkDevices refuses every device outside kvbox's fixed set (one file
// disk, at most one bridge NIC, a pty serial console, kvbox's agent
// channels, vsock, an rng from /dev/urandom, a balloon, and what libvirt
// adds: controllers, PS/2 input, audio none, a watchdog) and every device
// of the set that reaches beyond it (a chardev that is a host file or
// socket, an rng from another host device, a host input device, a
// watchdog that dumps to the host).
func checkDevices(dl *libvirtxml.DomainDeviceList, p PulledSpec) (pulledDevices, error) {
	var out pulledDevices
	for _, check := range []func(*libvirtxml.DomainDeviceList, PulledSpec, *pulledDevices) error{
		checkDeviceSet, checkDisk, checkNIC, checkConsole, checkAgentDevices, checkRNG, checkBalloon, checkLibvirtDevices,
	} {
		if err := check(dl, p, &out); err != nil {
			return out, err
		}
	}
	return out, nil
}

// checkDeviceSet refuses a kind of device outside kvbox's set, too many
// devices, and an emulator that is not a QEMU binary.
func checkDeviceSet(dl *libvirtxml.DomainDeviceList, p PulledSpec, out *pulledDevices) error {
	if extra := nonZero(dl, "Emulator", "Disks", "Controllers", "Interfaces", "Serials", "Consoles", "Channels",
		"Inputs", "Audios", "Watchdogs", "MemBalloon", "RNGs", "VSock", "IOMMU"); len(extra) > 0 {
		return refusedf("has a <%s> device (a pulled snapshot gets kvbox's own device set)", extra[0])
	}
	if n := len(dl.Controllers) + len(dl.Inputs) + len(dl.Audios) + len(dl.Watchdogs); n > maxPulledDevices {
		return refusedf("has %d controllers and other devices (at most %d)", n, maxPulledDevices)
	}
	if dl.Emulator != "" && dl.Emulator != p.SrcWrapper && !qemuPathRE.MatchString(dl.Emulator) {
		return refusedf("names the emulator %q (kvbox runs this host's QEMU)", printable(dl.Emulator))
	}
	return nil
}

// checkDisk: one qcow2 file on virtio vda, unencrypted.
func checkDisk(dl *libvirtxml.DomainDeviceList, p PulledSpec, out *pulledDevices) error {
	var err error
	if len(dl.Disks) != 1 {
		return refusedf("has %d disks (a kvbox box has one, its own overlay)", len(dl.Disks))
	}
	dk := dl.Disks[0]
	if dk.Device != "" && dk.Device != "disk" || dk.Source == nil || dk.Source.File == nil || dk.Source.Network != nil || dk.Source.Block != nil ||
		dk.Target == nil || dk.Target.Dev != "vda" || dk.Target.Bus != "virtio" || dk.Encryption != nil || dk.Source.Encryption != nil || dk.Source.DataStore != nil {
		return refusedf("has a disk that is not kvbox's (a qcow2 file on virtio vda)")
	}
	if out.diskAddr, err = pciAddr(dk.Address, "the disk"); err != nil {
		return err
	}
	return nil
}

// checkNIC: no NIC, or one virtio NIC on a bridge with a MAC and nothing
// more.
func checkNIC(dl *libvirtxml.DomainDeviceList, p PulledSpec, out *pulledDevices) error {
	var err error
	switch len(dl.Interfaces) {
	case 0:
	case 1:
		ifc := dl.Interfaces[0]
		if ifc.Source == nil || ifc.Source.Bridge == nil || nonZeroSource(ifc.Source) {
			return refusedf("has a network interface that is not on a bridge (a pulled snapshot's clone is on kvbox's)")
		}
		if extra := nonZero(&ifc, "MAC", "Source", "Target", "Model", "Driver", "FilterRef", "Link", "MTU", "Bandwidth",
			"PortOptions", "Alias", "Address", "Boot", "Guest", "Tune", "Coalesce", "ACPI"); len(extra) > 0 {
			return refusedf("has a network interface with <%s> (a pulled snapshot's NIC is kvbox's: a MAC on kvbox's bridge)", extra[0])
		}
		if ifc.MAC == nil {
			return refusedf("has a network interface without a MAC")
		}
		if hw, err := net.ParseMAC(ifc.MAC.Address); err != nil || len(hw) != 6 {
			return refusedf("has a network interface with the MAC %q", printable(ifc.MAC.Address))
		}
		if ifc.Model == nil || ifc.Model.Type != "virtio" {
			return refusedf("has a network interface that is not virtio")
		}
		out.mac = strings.ToLower(ifc.MAC.Address)
		if out.nicAddr, err = pciAddr(ifc.Address, "the network interface"); err != nil {
			return err
		}
	default:
		return refusedf("has %d network interfaces (a kvbox box has one at most)", len(dl.Interfaces))
	}
	return nil
}

// checkConsole: at most one serial port and one console, each a pty.
func checkConsole(dl *libvirtxml.DomainDeviceList, p PulledSpec, out *pulledDevices) error {
	if len(dl.Serials) > 1 || len(dl.Consoles) > 1 {
		return refusedf("has more than one serial port or console")
	}
	for _, s := range dl.Serials {
		if !ptyOnly(s.Source) || s.Protocol != nil || s.Target != nil && (s.Target.Port != nil && *s.Target.Port != 0 || s.Target.Type != "" && s.Target.Type != "isa-serial") {
			return refusedf("has a serial port that is not a pty (a file, socket or host device)")
		}
	}
	for _, c := range dl.Consoles {
		if !ptyOnly(c.Source) || c.Protocol != nil || c.Target != nil && c.Target.Type != "" && c.Target.Type != "serial" {
			return refusedf("has a console that is not a pty on the serial port (a file, socket or host device)")
		}
	}
	return nil
}

// checkAgentDevices: kvbox's agent channels, unix sockets with this
// host's names, each once and all of them, and a virtio vsock or none.
func checkAgentDevices(dl *libvirtxml.DomainDeviceList, p PulledSpec, out *pulledDevices) error {
	var err error
	out.agentAddr = map[string]*libvirtxml.DomainAddress{}
	want := domain.AgentSockets(p.Dir)
	for _, ch := range dl.Channels {
		if ch.Source == nil || ch.Source.UNIX == nil || nonZeroChardev(ch.Source) || ch.Source.UNIX.Mode != "bind" || ch.Source.UNIX.Reconnect != nil ||
			ch.Target == nil || ch.Target.VirtIO == nil || ch.Target.GuestFWD != nil || ch.Target.Xen != nil || ch.Protocol != nil ||
			!agentRE.MatchString(ch.Target.VirtIO.Name) {
			return refusedf("has a channel that is not one of kvbox's agent sockets (a file, a host socket or a guest forward)")
		}
		if _, dup := out.agentAddr[ch.Target.VirtIO.Name]; dup {
			return refusedf("has the agent channel %s twice", ch.Target.VirtIO.Name)
		}
		a, err := serialAddr(ch.Address)
		if err != nil {
			return err
		}
		out.agentAddr[ch.Target.VirtIO.Name] = a
	}
	out.vsock = dl.VSock != nil
	if out.vsock {
		if dl.VSock.Model != "" && dl.VSock.Model != "virtio" {
			return refusedf("has a vsock device that is not virtio")
		}
		if out.vsockAddr, err = pciAddr(dl.VSock.Address, "the vsock device"); err != nil {
			return err
		}
	}
	// Every box has them, vsock or not: its first contact is on its serial port.
	if len(dl.Channels) != len(want) {
		return refusedf("has %d agent channels, this kvbox makes %d", len(dl.Channels), len(want))
	}
	for _, w := range want {
		if _, ok := out.agentAddr[w.Name]; !ok {
			return refusedf("lacks the agent channel %s", w.Name)
		}
	}
	out.agents = want
	return nil
}

// checkRNG: one virtio rng fed by /dev/urandom or /dev/random.
func checkRNG(dl *libvirtxml.DomainDeviceList, p PulledSpec, out *pulledDevices) error {
	var err error
	switch len(dl.RNGs) {
	case 0:
		return refusedf("has no rng device (kvbox's boxes have one)")
	case 1:
		r := dl.RNGs[0]
		if r.Model != "virtio" || r.Backend == nil || r.Backend.EGD != nil ||
			r.Backend.Random != nil && r.Backend.Random.Device != "/dev/urandom" && r.Backend.Random.Device != "/dev/random" && r.Backend.Random.Device != "" {
			return refusedf("has an rng device fed by something other than /dev/urandom or /dev/random")
		}
		out.rngDevice = "/dev/urandom"
		if r.Backend.Random != nil && r.Backend.Random.Device == "/dev/random" {
			out.rngDevice = "/dev/random"
		}
		if out.rngAddr, err = pciAddr(r.Address, "the rng device"); err != nil {
			return err
		}
	default:
		return refusedf("has %d rng devices (a kvbox box has one)", len(dl.RNGs))
	}
	return nil
}

// checkBalloon: a virtio balloon or none.
func checkBalloon(dl *libvirtxml.DomainDeviceList, p PulledSpec, out *pulledDevices) error {
	var err error
	if b := dl.MemBalloon; b != nil {
		switch b.Model {
		case "virtio":
			out.balloon = true
			if out.balloonAddr, err = pciAddr(b.Address, "the balloon"); err != nil {
				return err
			}
		case "none":
		default:
			return refusedf("has a %q balloon (virtio or none)", printable(b.Model))
		}
	}
	return nil
}

// checkLibvirtDevices: what libvirt adds to a box (controllers, plain
// input devices, audio none, a watchdog that does not dump to the host),
// each copied as kvbox carries it.
func checkLibvirtDevices(dl *libvirtxml.DomainDeviceList, p PulledSpec, out *pulledDevices) error {
	for _, c := range dl.Controllers {
		cc, err := pulledController(c)
		if err != nil {
			return err
		}
		out.controllers = append(out.controllers, cc)
	}
	for _, in := range dl.Inputs {
		if in.Source != nil && (in.Source.EVDev != nil || in.Source.Passthrough != nil) || in.Driver != nil || in.Type != "mouse" && in.Type != "keyboard" && in.Type != "tablet" ||
			in.Bus != "" && in.Bus != "ps2" && in.Bus != "usb" && in.Bus != "virtio" || in.Model != "" && in.Model != "virtio" {
			return refusedf("has an input device that is not a plain mouse, keyboard or tablet (a host device)")
		}
		a, err := anyAddr(in.Address, "an input device")
		if err != nil {
			return err
		}
		out.inputs = append(out.inputs, libvirtxml.DomainInput{Type: in.Type, Bus: in.Bus, Model: in.Model, Address: a})
	}
	for _, au := range dl.Audios {
		if au.None == nil || nonZeroAudio(au) || au.ID < 0 || au.ID > 16 {
			return refusedf("has an audio backend other than none (a host sound device or file)")
		}
		out.audios = append(out.audios, libvirtxml.DomainAudio{ID: au.ID, None: &libvirtxml.DomainAudioNone{}})
	}
	for _, w := range dl.Watchdogs {
		switch w.Model {
		case "itco", "i6300esb", "ib700":
		default:
			return refusedf("has a %q watchdog", printable(w.Model))
		}
		switch w.Action {
		case "", "reset", "shutdown", "poweroff", "pause", "none", "inject-nmi":
		default:
			return refusedf("has a watchdog whose action is %q (a dump writes to the host)", printable(w.Action))
		}
		a, err := anyAddr(w.Address, "the watchdog")
		if err != nil {
			return err
		}
		out.watchdogs = append(out.watchdogs, libvirtxml.DomainWatchdog{Model: w.Model, Action: w.Action, Address: a})
	}
	return nil
}

func ptyOnly(s *libvirtxml.DomainChardevSource) bool {
	return s == nil || s.Pty != nil && !nonZeroChardev(s)
}

// nonZeroChardev: a chardev source sets more than one kind.
func nonZeroChardev(s *libvirtxml.DomainChardevSource) bool {
	n := 0
	rv := reflect.ValueOf(s).Elem()
	for i := 0; i < rv.NumField(); i++ {
		if !rv.Field(i).IsZero() {
			n++
		}
	}
	return n > 1
}

func nonZeroSource(s *libvirtxml.DomainInterfaceSource) bool { return len(nonZero(s, "Bridge")) > 0 }

func nonZeroAudio(a libvirtxml.DomainAudio) bool { return len(nonZero(&a, "ID", "None")) > 0 }

// pciAddr copies a PCI address (or none).
func pciAddr(a *libvirtxml.DomainAddress, what string) (*libvirtxml.DomainAddress, error) {
	if a == nil {
		return nil, nil
	}
	if a.PCI == nil || len(nonZero(a, "PCI")) > 0 || a.PCI.ZPCI != nil || a.PCI.MultiFunction != "" && a.PCI.MultiFunction != "on" && a.PCI.MultiFunction != "off" {
		return nil, refusedf("gives %s an address that is not a PCI address", what)
	}
	c := *a.PCI
	return &libvirtxml.DomainAddress{PCI: &libvirtxml.DomainAddressPCI{Domain: c.Domain, Bus: c.Bus, Slot: c.Slot, Function: c.Function, MultiFunction: c.MultiFunction}}, nil
}

func serialAddr(a *libvirtxml.DomainAddress) (*libvirtxml.DomainAddress, error) {
	if a == nil {
		return nil, nil
	}
	if a.VirtioSerial == nil || len(nonZero(a, "VirtioSerial")) > 0 {
		return nil, refusedf("gives an agent channel an address that is not a virtio-serial port")
	}
	c := *a.VirtioSerial
	return &libvirtxml.DomainAddress{VirtioSerial: &c}, nil
}

// anyAddr copies a PCI, USB or ISA address (or none).
func anyAddr(a *libvirtxml.DomainAddress, what string) (*libvirtxml.DomainAddress, error) {
	switch {
	case a == nil:
		return nil, nil
	case a.PCI != nil:
		return pciAddr(a, what)
	case a.USB != nil && len(nonZero(a, "USB")) == 0:
		c := *a.USB
		if len(c.Port) > 16 || strings.Trim(c.Port, "0123456789.") != "" {
			break
		}
		return &libvirtxml.DomainAddress{USB: &c}, nil
	case a.ISA != nil && len(nonZero(a, "ISA")) == 0:
		c := *a.ISA
		return &libvirtxml.DomainAddress{ISA: &c}, nil
	}
	return nil, refusedf("gives %s an address kvbox does not take", what)
}

// pulledController copies a controller libvirt adds to a box: PCI(e)
// buses and ports, USB, SATA, IDE and virtio-serial; numbers and model
// names only.
func pulledController(c libvirtxml.DomainController) (libvirtxml.DomainController, error) {
	models := map[string][]string{
		"pci":           {"pci-root", "pcie-root", "pcie-root-port", "pci-bridge", "dmi-to-pci-bridge", "pcie-to-pci-bridge", "pcie-switch-upstream-port", "pcie-switch-downstream-port"},
		"usb":           {"", "qemu-xhci", "nec-xhci", "ich9-ehci1", "ich9-uhci1", "ich9-uhci2", "ich9-uhci3", "piix3-uhci", "piix4-uhci", "none"},
		"sata":          {""},
		"ide":           {"", "piix3", "piix4", "ich6"},
		"virtio-serial": {"", "virtio"},
	}
	ok := false
	for _, m := range models[c.Type] {
		ok = ok || m == c.Model
	}
	if !ok || c.XenBus != nil || c.NVME != nil || c.Index == nil || *c.Index > 255 {
		return libvirtxml.DomainController{}, refusedf("has a %q controller of model %q (kvbox's boxes have PCI, USB, SATA and virtio-serial ones)", printable(c.Type), printable(c.Model))
	}
	idx := *c.Index
	out := libvirtxml.DomainController{Type: c.Type, Index: &idx, Model: c.Model}
	if c.PCI != nil {
		pci := &libvirtxml.DomainControllerPCI{}
		if c.PCI.Model != nil {
			if c.PCI.Model.Name != "" && !cpuNameRE.MatchString(c.PCI.Model.Name) {
				return out, refusedf("has a PCI controller model name kvbox does not take")
			}
			pci.Model = &libvirtxml.DomainControllerPCIModel{Name: c.PCI.Model.Name}
		}
		if t := c.PCI.Target; t != nil {
			if t.Hotplug != "" && t.Hotplug != "on" && t.Hotplug != "off" || t.MemReserve != nil {
				return out, refusedf("has a PCI controller target kvbox does not take")
			}
			pci.Target = &libvirtxml.DomainControllerPCITarget{ChassisNr: t.ChassisNr, Chassis: t.Chassis, Port: t.Port, BusNr: t.BusNr, Index: t.Index, Hotplug: t.Hotplug}
		}
		if pci.Model != nil || pci.Target != nil {
			out.PCI = pci
		}
	}
	if c.USB != nil {
		u := &libvirtxml.DomainControllerUSB{Port: c.USB.Port}
		if c.USB.Master != nil {
			m := *c.USB.Master
			u.Master = &m
		}
		out.USB = u
	}
	if c.VirtIOSerial != nil {
		v := *c.VirtIOSerial
		out.VirtIOSerial = &v
	}
	a, err := anyAddr(c.Address, "a controller")
	if err != nil {
		return out, err
	}
	out.Address = a
	return out, nil
}

// checkQemuArgs: the pushed qemu:commandline may hold kvbox's RAM backend
// (any of the forms kvbox wrote: anonymous, the box's file, a snapshot's
// mapping) and -incoming, nothing else; the pulled XML gets kvbox's
// anonymous RAM backend of the recorded size (a clone maps its snapshot
// instead, cloneQemuArgs). Environment variables are refused.
func checkQemuArgs(cl *libvirtxml.DomainQEMUCommandline, size int64) ([]string, error) {
	if cl == nil {
		return nil, refusedf("lacks kvbox's RAM backend (qemu:commandline)")
	}
	if len(cl.Envs) > 0 {
		return nil, refusedf("sets QEMU's environment (qemu:env %s)", printable(cl.Envs[0].Name))
	}
	obj, machine := false, false
	for i := 0; i < len(cl.Args); i++ {
		a, next := cl.Args[i].Value, ""
		if i+1 < len(cl.Args) {
			next = cl.Args[i+1].Value
		}
		switch {
		case a == "-object" && kvboxRAM(next, size) && !obj:
			obj = true
		case a == "-machine" && next == "memory-backend="+domain.RAMBackendID && !machine:
			machine = true
		case a == "-incoming" && next == "defer":
		default:
			return nil, refusedf("passes QEMU the argument %q (a pulled snapshot runs kvbox's own command line)", printable(a))
		}
		i++
	}
	if !obj || !machine {
		return nil, refusedf("lacks kvbox's RAM backend (-object ...,id=%s and -machine memory-backend=%s) of %d bytes", domain.RAMBackendID, domain.RAMBackendID, size)
	}
	return domain.RAMArgs(size), nil
}

// kvboxRAM says whether a -object value is kvbox's RAM backend of size
// bytes in a form kvbox writes.
func kvboxRAM(v string, size int64) bool {
	opts := domain.SplitQemuOpts(v)
	if len(opts) < 3 || opts[0] != "memory-backend-ram" && opts[0] != "memory-backend-file" {
		return false
	}
	seen := map[string]bool{}
	for _, o := range opts[1:] {
		k, val, ok := strings.Cut(o, "=")
		if !ok || seen[k] {
			return false
		}
		seen[k] = true
		switch k {
		case "id":
			if val != domain.RAMBackendID {
				return false
			}
		case "size":
			if val != strconv.FormatInt(size, 10) {
				return false
			}
		case "mem-path", "share", "readonly", "rom", "offset":
			// the file backend's: replaced (a clone maps its own snapshot)
		default:
			return false
		}
	}
	return seen["id"] && seen["size"]
}

// checkOverride: the pushed qemu:override may only be kvbox's balloon
// properties; reports whether it has them.
func checkOverride(o *libvirtxml.DomainQEMUOverride) (bool, error) {
	if o == nil || len(o.Devices) == 0 {
		return false, nil
	}
	if len(o.Devices) != 1 || o.Devices[0].Alias != domain.BalloonAlias {
		return false, refusedf("overrides properties of QEMU device %q (a pulled snapshot runs kvbox's own devices)", printable(o.Devices[0].Alias))
	}
	for _, p := range o.Devices[0].Frontend.Properties {
		switch {
		case p.Name == "free-page-hint" && p.Type == "bool" && (p.Value == "true" || p.Value == "false"):
		case p.Name == "iothread" && p.Type == "string" && p.Value == "iothread1":
		default:
			return false, refusedf("overrides the balloon's property %q (kvbox sets free-page-hint and iothread only)", printable(p.Name))
		}
	}
	return true, nil
}

// graftDevices gives the template's devices the pushed addresses and
// libvirt's defaults taken by checkDevices.
func graftDevices(t *libvirtxml.DomainDeviceList, p pulledDevices) error {
	if len(t.Disks) != 1 {
		return errors.New("kvbox's template has no single disk")
	}
	t.Disks[0].Address = p.diskAddr
	if p.mac != "" {
		if len(t.Interfaces) != 1 {
			return errors.New("kvbox's template has no single interface")
		}
		t.Interfaces[0].Address = p.nicAddr
	}
	for i := range t.Channels {
		if t.Channels[i].Target != nil && t.Channels[i].Target.VirtIO != nil {
			t.Channels[i].Address = p.agentAddr[t.Channels[i].Target.VirtIO.Name]
		}
	}
	if t.VSock != nil {
		t.VSock.Address = p.vsockAddr
	}
	if len(t.RNGs) == 1 {
		t.RNGs[0].Address = p.rngAddr
		if t.RNGs[0].Backend != nil && t.RNGs[0].Backend.Random != nil {
			t.RNGs[0].Backend.Random.Device = p.rngDevice
		}
	}
	if t.MemBalloon != nil {
		if p.balloon {
			t.MemBalloon.Address = p.balloonAddr
		} else {
			t.MemBalloon = &libvirtxml.DomainMemBalloon{Model: "none"}
		}
	}
	t.Controllers = p.controllers
	t.Inputs = p.inputs
	t.Audios = p.audios
	t.Watchdogs = p.watchdogs
	return nil
}

// printable is s with every byte that is not printable ASCII escaped, cut
// to a length that fits a line: it goes into a message.
func printable(s string) string {
	if len(s) > 80 {
		s = s[:80] + "..."
	}
	q := strconv.QuoteToASCII(s)
	return q[1 : len(q)-1]
}

func oneLine(s string) string { return printable(strings.ReplaceAll(s, "\n", " ")) }

// OwnerFile, in a snapshot's folder, marks a snapshot that a program
// beside kvbox keeps for itself in the state dir: kvbox-node's snapshot
// cache marks each snapshot it pulled (OwnerKvboxNode, and the artifact's
// digest). No kvbox command or pull writes it (a pulled artifact's parts
// are files kvbox knows, and this is none of them), and a push does not
// carry it; a front that lets others make, clone or remove snapshots
// (kvbox serve) leaves a marked snapshot alone.
const OwnerFile = "owner.json"

// OwnerKvboxNode is the owner kvbox-node's cache writes.
const OwnerKvboxNode = "kvbox-node"

// Owner is what an OwnerFile says.
type Owner struct {
	Owner  string `json:"owner"`            // the program, e.g. OwnerKvboxNode
	Digest string `json:"digest,omitempty"` // the artifact a pull fetched it from
}

// maxOwnerBytes bounds what OwnerOf reads.
const maxOwnerBytes = 4 << 10

// SetOwner marks s as o.Owner's (root's file alone, written atomically).
func SetOwner(s Snapshot, o Owner) error {
	if o.Owner == "" {
		return base.Errorf(base.Invalid, "a snapshot's owner mark needs an owner")
	}
	b, err := json.Marshal(o)
	if err != nil {
		return err
	}
	if err := overlay.WriteFileAtomic(filepath.Join(s.Dir, OwnerFile), append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("mark snapshot %s as %s's: %w", s.Name, o.Owner, err)
	}
	return overlay.SyncDir(s.Dir)
}

// OwnerOf is s's owner mark; ok is false for a snapshot that has none
// (kvbox's own, or anyone's who can make snapshots).
func OwnerOf(s Snapshot) (o Owner, ok bool, err error) {
	f, err := domain.OpenNoFollow(filepath.Join(s.Dir, OwnerFile), os.O_RDONLY)
	if errors.Is(err, os.ErrNotExist) {
		return Owner{}, false, nil
	}
	if err != nil {
		return Owner{}, false, fmt.Errorf("snapshot %s's owner mark: %w", s.Name, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxOwnerBytes+1))
	if err != nil {
		return Owner{}, false, fmt.Errorf("snapshot %s's owner mark: %w", s.Name, err)
	}
	if len(b) > maxOwnerBytes || json.Unmarshal(b, &o) != nil || o.Owner == "" {
		return Owner{}, false, base.Errorf(base.Invalid, "snapshot %s has an owner mark (%s) kvbox cannot read", s.Name, OwnerFile)
	}
	return o, true, nil
}
