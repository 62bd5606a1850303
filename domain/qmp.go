package domain

import (
	"os"
	"path/filepath"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/qmp"
)

// QMP returns a QMP client for the named box's QEMU that records its
// transcript (see qmp.Transcript) in the layout's QMPLog, root's only: it
// outlives a failed creation, for the post-mortem, and goes with Remove.
func (h *Host) QMP(dom *libvirt.Domain, name string) *qmp.Client {
	os.MkdirAll(filepath.Dir(h.Layout().QMPLog(name)), 0o700)
	c := qmp.NewDomainClient(dom)
	c.Transcript = &qmp.Transcript{Path: h.Layout().QMPLog(name)}
	return c
}
