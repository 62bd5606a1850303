package domain

import (
	"os"
	"path/filepath"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/qmp"
)

// QMPLog is the transcript of the QMP commands kvbox sent to a box's QEMU and
// QEMU's replies (see qmp.Transcript), in logs/ (root's only). It outlives a
// failed creation, for the post-mortem, and goes with Remove.
func (h *Host) QMPLog(name string) string {
	return filepath.Join(h.StateDir, "logs", name+".qmp.log")
}

// QMP returns a QMP client for the named box's QEMU that records its
// transcript in QMPLog(name).
func (h *Host) QMP(dom *libvirt.Domain, name string) *qmp.Client {
	os.MkdirAll(filepath.Dir(h.QMPLog(name)), 0o700)
	c := qmp.NewDomainClient(dom)
	c.Transcript = &qmp.Transcript{Path: h.QMPLog(name)}
	return c
}
