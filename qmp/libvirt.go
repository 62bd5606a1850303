package qmp

import (
	"context"
	"errors"

	gqmp "github.com/digitalocean/go-qemu/qmp"
	"libvirt.org/go/libvirt"
)

// DomainMonitor is a go-qemu qmp.Monitor over libvirt's
// virDomainQemuMonitorCommand: commands share libvirt's own monitor
// connection, so there is no second socket and libvirt serialises them with
// its own jobs. libvirt returns QEMU's reply verbatim, error replies included,
// which keeps the QMP error class for Client.
type DomainMonitor struct {
	dom *libvirt.Domain
}

var _ gqmp.Monitor = (*DomainMonitor)(nil)

// ErrEventsViaLibvirt is returned by DomainMonitor.Events: libvirt owns the
// QMP event stream (use its domain event callbacks instead).
var ErrEventsViaLibvirt = errors.New("qmp: events are delivered by libvirt, not through this monitor")

// NewDomainMonitor returns a Monitor for a running domain. The caller keeps
// ownership of dom.
func NewDomainMonitor(dom *libvirt.Domain) *DomainMonitor {
	return &DomainMonitor{dom: dom}
}

// NewDomainClient is New(NewDomainMonitor(dom)).
func NewDomainClient(dom *libvirt.Domain) *Client {
	return New(NewDomainMonitor(dom))
}

// Connect is a no-op: libvirt holds the connection.
func (m *DomainMonitor) Connect() error { return nil }

// Disconnect is a no-op: libvirt holds the connection.
func (m *DomainMonitor) Disconnect() error { return nil }

// Run sends one QMP command through libvirt and returns QEMU's reply.
func (m *DomainMonitor) Run(command []byte) ([]byte, error) {
	out, err := m.dom.QemuMonitorCommand(string(command), libvirt.DOMAIN_QEMU_MONITOR_COMMAND_DEFAULT)
	if err != nil {
		return nil, err
	}
	return []byte(out), nil
}

// Events always fails with ErrEventsViaLibvirt.
func (m *DomainMonitor) Events(context.Context) (<-chan gqmp.Event, error) {
	return nil, ErrEventsViaLibvirt
}
