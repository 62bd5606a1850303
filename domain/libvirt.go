package domain

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
)

// DefaultURI is the libvirt connection kvbox uses unless told otherwise:
// LIBVIRT_DEFAULT_URI, else qemu:///system, as virsh does.
func DefaultURI() string {
	if u := os.Getenv("LIBVIRT_DEFAULT_URI"); u != "" {
		return u
	}
	return "qemu:///system"
}

// Connect opens libvirt. A daemon that does not answer is Unavailable.
// The connection sends keepalives, and libvirt's event loop runs in this
// process (once): a libvirtd that restarted or went away shows as a
// connection that is not alive (Host.Conn then makes a new one), rather
// than as the failure of the next call on it.
func Connect(uri string) (*libvirt.Connect, error) {
	startEventLoop()
	c, err := libvirt.NewConnect(uri)
	if err != nil {
		return nil, base.Errorf(base.Unavailable, "cannot reach libvirt at %s (is libvirtd running?): %s", uri, LibvirtMessage(err))
	}
	c.SetKeepAlive(5, 3) // a driver without keepalives (test:///) refuses: fine
	return c, nil
}

var eventLoop sync.Once

// startEventLoop runs libvirt's default event loop, which watches the
// connections' sockets and sends their keepalives.
func startEventLoop() {
	eventLoop.Do(func() {
		if libvirt.EventRegisterDefaultImpl() != nil {
			return
		}
		go func() {
			for {
				if libvirt.EventRunDefaultImpl() != nil {
					time.Sleep(time.Second)
				}
			}
		}()
	})
}

// LibvirtMessage is the message of a libvirt error without its code prefix.
func LibvirtMessage(err error) string {
	var le libvirt.Error
	if errors.As(err, &le) {
		return le.Message
	}
	return err.Error()
}

func isNoDomain(err error) bool {
	var le libvirt.Error
	return errors.As(err, &le) && le.Code == libvirt.ERR_NO_DOMAIN
}

// hostFacts are what kvbox reads from libvirt's capabilities.
type hostFacts struct {
	domainType  string // kvm where the host offers it, else qemu
	uid, gid    int    // who QEMU runs as (the DAC label), -1 when unknown
	qemu        string // the x86_64 QEMU binary libvirt runs by default
	macSecurity bool   // libvirt confines QEMU (AppArmor, SELinux)
}

var baselabelRE = regexp.MustCompile(`<baselabel type='(\w+)'>\+?(\d+):\+?(\d+)</baselabel>`)

func readHostFacts(c *libvirt.Connect) (hostFacts, error) {
	caps, err := c.GetCapabilities()
	if err != nil {
		return hostFacts{}, fmt.Errorf("read libvirt capabilities: %s", LibvirtMessage(err))
	}
	f := hostFacts{domainType: "qemu", uid: -1, gid: -1}
	if kvmRunsStockKernels() && strings.Contains(caps, "<domain type='kvm'") {
		f.domainType = "kvm"
	}
	for _, m := range baselabelRE.FindAllStringSubmatch(caps, -1) {
		if m[1] == "kvm" || m[1] == "qemu" { // both run QEMU as the same user
			f.uid, _ = strconv.Atoi(m[2])
			f.gid, _ = strconv.Atoi(m[3])
		}
	}
	if m := qemuEmulatorRE.FindStringSubmatch(caps); m != nil {
		f.qemu = m[1]
	}
	f.macSecurity = macModelRE.MatchString(caps)
	return f, nil
}

// DACLabel is the static DAC label boxes run QEMU with, "+UID:+GID" of
// libvirt's QEMU user; "" when libvirt reports none (QEMU as root).
func (h *Host) DACLabel() (string, error) {
	f, err := h.hostFacts()
	if err != nil || f.uid < 0 {
		return "", err
	}
	return fmt.Sprintf("+%d:+%d", f.uid, f.gid), nil
}

// kvmRunsStockKernels reports whether /dev/kvm is hardware virtualization
// (kvm_intel or kvm_amd). A /dev/kvm from kvm_pvm (pagetable-based nested
// virtualization, seen on cloud sandboxes whose CPUs lack vmx/svm) only runs
// PVM-enabled guest kernels; Debian's kernels hang in it before printing a
// line, so kvbox uses TCG there unless told otherwise.
func kvmRunsStockKernels() bool {
	if _, err := os.Stat("/dev/kvm"); err != nil {
		return false
	}
	for _, m := range []string{"kvm_intel", "kvm_amd"} {
		if _, err := os.Stat("/sys/module/" + m); err == nil {
			return true
		}
	}
	return false
}
