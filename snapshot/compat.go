package snapshot

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"libvirt.org/go/libvirt"
	"libvirt.org/go/libvirtxml"

	agent "kvbox.dev/kvbox/guest-agent"
)

// Compat is what a restore of the snapshot needs from a host: the same
// domain type, a machine type the host's QEMU offers, a QEMU at least as
// new as the one that wrote the state, and a CPU the host can give.
type Compat struct {
	DomainType string `json:"domain_type"` // kvm or qemu (TCG)
	Arch       string `json:"arch"`
	Machine    string `json:"machine"` // as in the live XML: the canonical type, e.g. pc-q35-10.0
	CPUMode    string `json:"cpu_mode"`
	CPUModel   string `json:"cpu_model,omitempty"`
	QEMU       uint64 `json:"qemu"`    // major*1e6+minor*1e3+micro, from libvirt
	Libvirt    uint64 `json:"libvirt"` // same encoding
	// HostCPU is the <cpu> of the host that took the snapshot, for a
	// host-passthrough/host-model CPU on KVM (libvirt compares it).
	HostCPU string `json:"host_cpu,omitempty"`
	// Agent is the version of the kvbox-agent running in the snapshot
	// ("" when it did not answer): a host whose kvbox speaks another
	// major protocol version could not re-identify its clones.
	Agent string `json:"agent,omitempty"`
}

// CompatFile, in a snapshot folder, keeps the snapshot's Compat as it was
// when the snapshot was taken (or, for a pulled one, on the host that took
// it): the versions of that host, not of this one today.
const CompatFile = "compat.json"

// LoadCompat returns what the snapshot in dir needs: its CompatFile, which
// every snapshot has (taken here, or pulled).
func LoadCompat(dir string) (Compat, error) {
	b, err := os.ReadFile(filepath.Join(dir, CompatFile))
	if err != nil {
		return Compat{}, fmt.Errorf("snapshot in %s: what it needs of a host (%s): %w", dir, CompatFile, err)
	}
	var c Compat
	if err := json.Unmarshal(b, &c); err != nil {
		return Compat{}, fmt.Errorf("%s: %w", filepath.Join(dir, CompatFile), err)
	}
	return c, nil
}

func version(v uint64) string {
	return fmt.Sprintf("%d.%d.%d", v/1000000, v/1000%1000, v%1000)
}

// CompatOf reads what the snapshot's live domain XML needs, with the
// versions of the host that holds it.
func CompatOf(conn *libvirt.Connect, domainXML string) (Compat, error) {
	var d libvirtxml.Domain
	if err := d.Unmarshal(domainXML); err != nil {
		return Compat{}, fmt.Errorf("snapshot domain XML: %w", err)
	}
	c := Compat{DomainType: d.Type}
	if d.OS != nil && d.OS.Type != nil {
		c.Arch, c.Machine = d.OS.Type.Arch, d.OS.Type.Machine
	}
	if d.CPU != nil {
		c.CPUMode = d.CPU.Mode
		if d.CPU.Model != nil {
			c.CPUModel = d.CPU.Model.Value
		}
	}
	q, err := conn.GetVersion()
	if err != nil {
		return Compat{}, err
	}
	l, err := conn.GetLibVersion()
	if err != nil {
		return Compat{}, err
	}
	c.QEMU, c.Libvirt = uint64(q), uint64(l)
	if capsXML, err := conn.GetCapabilities(); err == nil {
		var caps libvirtxml.Caps
		if caps.Unmarshal(capsXML) == nil && caps.Host.CPU != nil {
			cpu := libvirtxml.DomainCPU{Model: &libvirtxml.DomainCPUModel{Value: caps.Host.CPU.Model}, Vendor: caps.Host.CPU.Vendor}
			for _, f := range caps.Host.CPU.FeatureFlags {
				cpu.Features = append(cpu.Features, libvirtxml.DomainCPUFeature{Policy: "require", Name: f.Name})
			}
			if s, err := cpu.Marshal(); err == nil {
				c.HostCPU = s
			}
		}
	}
	return c, nil
}

// ErrIncompatible is what Check's refusals are (errors.Is): this host
// cannot restore the snapshot, and waiting does not help.
var ErrIncompatible = errors.New("incompatible host")

// incompatible is a refusal of Check: one line, ErrIncompatible beneath.
func incompatible(format string, a ...any) error {
	return &incompatibleError{"incompatible host: " + fmt.Sprintf(format, a...)}
}

type incompatibleError struct{ msg string }

func (e *incompatibleError) Error() string        { return e.msg }
func (e *incompatibleError) Is(target error) bool { return target == ErrIncompatible }

// Check says in one line what this host lacks to restore a snapshot that
// needs c, or nil when it has everything. hostType is the domain type
// kvbox uses on this host ("kvm" or "qemu"; "" if unknown): libvirt lists
// kvm in its capabilities even where /dev/kvm cannot be used.
func (c Compat) Check(conn *libvirt.Connect, hostType string) error {
	if c.Agent != "" && major(c.Agent) != major(agent.Version) {
		return incompatible("the snapshot's kvbox-agent speaks protocol %s, this kvbox speaks %s (major versions differ)", c.Agent, agent.Version)
	}
	if c.DomainType == "kvm" && hostType != "" && hostType != "kvm" {
		return incompatible("the snapshot needs domain type kvm (hardware virtualization), this host runs %s only", hostType)
	}
	capsXML, err := conn.GetCapabilities()
	if err != nil {
		return err
	}
	var caps libvirtxml.Caps
	if err := caps.Unmarshal(capsXML); err != nil {
		return err
	}
	types, machines := offered(caps, c.Arch)
	if !slices.Contains(types, c.DomainType) {
		return incompatible("the snapshot needs domain type %s on %s, this host offers %s", c.DomainType, c.Arch, orNone(types))
	}
	if !slices.Contains(machines, c.Machine) {
		return incompatible("the snapshot needs machine type %s, this host's QEMU does not offer it", c.Machine)
	}
	q, err := conn.GetVersion()
	if err != nil {
		return err
	}
	if uint64(q) < c.QEMU {
		return incompatible("the snapshot was written by QEMU %s, this host has the older QEMU %s", version(c.QEMU), version(uint64(q)))
	}
	return c.checkCPU(conn)
}

// offered lists what a host whose capabilities are caps offers a guest of
// arch: its domain types, and its machine types by name and by canonical
// name (a snapshot's machine is the canonical one of its live XML), sorted,
// each once.
func offered(caps libvirtxml.Caps, arch string) (types, machines []string) {
	for _, g := range caps.Guests {
		if g.Arch.Name != arch {
			continue
		}
		for _, d := range g.Arch.Domains {
			types = append(types, d.Type)
		}
		for _, m := range g.Arch.Machines {
			machines = append(machines, m.Name)
			if m.Canonical != "" {
				machines = append(machines, m.Canonical)
			}
		}
	}
	slices.Sort(types)
	slices.Sort(machines)
	return slices.Compact(types), slices.Compact(machines)
}

// HostCompat is this host's side of Compat, its restore class: what it
// offers a snapshot, in the terms Check compares. A snapshot restores here
// when its DomainType is kvm only if this host's is, its Arch is this
// host's, its Machine is one of Machines, its QEMU is at most this host's
// and its agent protocol's major version is Agent's; Check has the last
// word (it also compares CPUs, which these facts leave out).
type HostCompat struct {
	// DomainType is the domain type kvbox uses here (kvm or qemu).
	DomainType string `json:"domain_type"`
	Arch       string `json:"arch"`
	// DomainTypes are the domain types libvirt offers for Arch.
	DomainTypes []string `json:"domain_types"`
	// Machines are the machine types QEMU offers for Arch.
	Machines []string `json:"machines"`
	QEMU     uint64   `json:"qemu"`    // Compat's encoding
	Libvirt  uint64   `json:"libvirt"` // same encoding
	// Agent is the agent protocol version this kvbox speaks.
	Agent string `json:"agent"`
}

// AgentProtocol is the major version of the agent protocol this host
// speaks: a snapshot restores here only if its agent's is the same.
func (h HostCompat) AgentProtocol() string { return major(h.Agent) }

// HostCompatOf reads this host's restore class from libvirt. hostType is
// the domain type kvbox uses here (domain.Host.DomainType).
func HostCompatOf(conn *libvirt.Connect, hostType string) (HostCompat, error) {
	capsXML, err := conn.GetCapabilities()
	if err != nil {
		return HostCompat{}, err
	}
	q, err := conn.GetVersion()
	if err != nil {
		return HostCompat{}, err
	}
	l, err := conn.GetLibVersion()
	if err != nil {
		return HostCompat{}, err
	}
	return hostCompatFromCaps(capsXML, hostType, uint64(q), uint64(l))
}

func hostCompatFromCaps(capsXML, hostType string, qemu, lib uint64) (HostCompat, error) {
	var caps libvirtxml.Caps
	if err := caps.Unmarshal(capsXML); err != nil {
		return HostCompat{}, fmt.Errorf("libvirt capabilities: %w", err)
	}
	if caps.Host.CPU == nil || caps.Host.CPU.Arch == "" {
		return HostCompat{}, fmt.Errorf("libvirt capabilities name no host CPU architecture")
	}
	h := HostCompat{DomainType: hostType, Arch: caps.Host.CPU.Arch, QEMU: qemu, Libvirt: lib, Agent: agent.Version}
	h.DomainTypes, h.Machines = offered(caps, h.Arch)
	return h, nil
}

// checkCPU: on KVM a host CPU at least the snapshot's (libvirt's
// comparison), and a custom CPU model usable here.
func (c Compat) checkCPU(conn *libvirt.Connect) error {
	if c.DomainType == "kvm" && c.HostCPU != "" && (c.CPUMode == "host-passthrough" || c.CPUMode == "host-model") {
		r, err := conn.CompareCPU(c.HostCPU, 0)
		if err != nil {
			return fmt.Errorf("compare CPU: %w", err)
		}
		if r == libvirt.CPU_COMPARE_INCOMPATIBLE {
			return incompatible("its CPU lacks features of the CPU that took the snapshot (%s mode)", c.CPUMode)
		}
	}
	if c.CPUMode != "custom" || c.CPUModel == "" {
		return nil
	}
	dc, err := conn.GetDomainCapabilities("", c.Arch, c.Machine, c.DomainType, 0)
	if err != nil {
		return nil
	}
	var caps libvirtxml.DomainCaps
	if caps.Unmarshal(dc) != nil || caps.CPU == nil {
		return nil
	}
	for _, m := range caps.CPU.Modes {
		if m.Name != "custom" {
			continue
		}
		for _, mod := range m.Models {
			if mod.Name == c.CPUModel && mod.Usable == "no" {
				return incompatible("CPU model %s is not usable here", c.CPUModel)
			}
		}
	}
	return nil
}

// major is the major version of a "MAJOR.MINOR.PATCH" version.
func major(v string) string {
	m, _, _ := strings.Cut(v, ".")
	return m
}

func orNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}
