// Package domain owns boxes as libvirt domains: their XML (rendered from a
// template, with kvbox's facts in the domain's metadata), their folders on
// the host, and their life cycle (create, start, stop, remove), including
// waiting for a box's guest agent and giving the guest its identity. It
// also holds kvbox's sentinel errors and name and size rules.
package domain

import (
	"os"
	"os/exec"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/statedir"
)

// AgentPorts is how many virtio-serial ports a box offers its agent: QEMU's
// unix chardev serves one host connection at a time, so each concurrent
// kvbox command talking to one box takes a port of its own.
const AgentPorts = 4

// Host is kvbox on one libvirt host: the connection, the state directory
// and the network boxes are put on.
type Host struct {
	Conn     *libvirt.Connect
	URI      string
	StateDir string
	Net      network.Config
	// Template is the domain XML template boxes are defined from.
	Template string
	// DomainTypeOverride forces the libvirt domain type (kvm or qemu);
	// empty picks kvm where the host offers it.
	DomainTypeOverride string
	// Interrupt, when set, ends a wait on a lock another kvbox holds (the
	// CLI closes it on Ctrl-C or SIGTERM); nil waits for as long as it takes.
	Interrupt <-chan struct{}
	// ReaperCommand builds the command of a detached reaper (kvbox re-run
	// as `kvbox ... __reap KIND NAME ID`); nil starts none.
	ReaperCommand func(kind, name, id string) *exec.Cmd
	facts         *hostFacts
}

// Layout is the host's state directory.
func (h *Host) Layout() statedir.Layout { return statedir.Layout{Root: h.StateDir} }

func (h *Host) hostFacts() (hostFacts, error) {
	if h.facts == nil {
		f, err := readHostFacts(h.Conn)
		if err != nil {
			return hostFacts{}, err
		}
		h.facts = &f
	}
	return *h.facts, nil
}

// DomainType is kvm where the host offers it, else qemu (TCG).
func (h *Host) DomainType() (string, error) {
	if h.DomainTypeOverride != "" {
		return h.DomainTypeOverride, nil
	}
	f, err := h.hostFacts()
	return f.domainType, err
}

// ChownForQEMU gives a path to the user QEMU runs as, so QEMU can create its
// agent sockets and saved state in a box's folder.
func (h *Host) ChownForQEMU(path string) error {
	f, err := h.hostFacts()
	if err != nil || f.uid < 0 {
		return err
	}
	return os.Lchown(path, f.uid, f.gid)
}
