// Package domain owns boxes as libvirt domains: their XML (rendered from a
// template, with kvbox's facts in the domain's metadata), their folders on
// the host, and their life cycle (create, start, stop, remove), including
// waiting for a box's guest agent and giving the guest its identity.
package domain

import (
	"errors"
	"os"
	"sync"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/statedir"
)

// AgentPorts is how many virtio-serial ports a box offers its agent: QEMU's
// unix chardev serves one host connection at a time, so each concurrent
// kvbox command talking to one box takes a port of its own.
const AgentPorts = 4

// Host is kvbox on one libvirt host: the connection, the state directory
// and the network boxes are put on. It is safe for concurrent use once its
// fields are set; its connection is made again when libvirtd restarted.
type Host struct {
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

	mu    sync.Mutex
	conn  *libvirt.Connect
	facts *hostFacts
}

// SetConn gives the host its libvirt connection (Connect's, or a test
// driver's).
func (h *Host) SetConn(c *libvirt.Connect) {
	h.mu.Lock()
	h.conn = c
	h.mu.Unlock()
}

// Conn is the host's libvirt connection. One libvirtd closed (it
// restarted, or dropped an idle client) is replaced by a new one to URI
// first; when that fails the broken one is returned, and what is asked of
// it fails with libvirt's error.
func (h *Host) Conn() *libvirt.Connect {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.conn == nil || h.URI == "" {
		return h.conn
	}
	alive, err := h.conn.IsAlive()
	if err == nil && alive {
		return h.conn
	}
	if c, cerr := Connect(h.URI); cerr == nil {
		if err == nil { // an invalid pointer is not closed twice
			h.conn.Close()
		}
		h.conn = c
	}
	return h.conn
}

// Close closes the host's libvirt connection.
func (h *Host) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.conn == nil {
		return nil
	}
	_, err := h.conn.Close()
	h.conn = nil
	return err
}

// Define defines (or redefines) a domain from its XML and frees libvirt's
// handle: for a definition kvbox does not use right after (a box's next
// boot, a suspended box's). The error is libvirt's message.
func (h *Host) Define(xml string) error {
	d, err := h.Conn().DomainDefineXML(xml)
	if err != nil {
		return errors.New(LibvirtMessage(err))
	}
	return d.Free()
}

// Layout is the host's state directory.
func (h *Host) Layout() statedir.Layout { return statedir.Layout{Root: h.StateDir} }

func (h *Host) hostFacts() (hostFacts, error) {
	conn := h.Conn()
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.facts == nil {
		f, err := readHostFacts(conn)
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
