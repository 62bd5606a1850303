package domain

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/overlay"
)

// The RAM-first emulator (TCG hosts only).
//
// libvirt gives every q35 domain a RAM backend of its own ("pc.ram", the
// first RAM block QEMU allocates, at ram_addr 0) that a box does not use:
// kvbox's qemu:commandline backend (kvbox.ram) replaces it
// and comes after it. Under TCG that order breaks live memory copies in
// QEMU 10.0: after each dirty-bitmap sync QEMU re-arms the vCPUs' write
// tracking for the block at ram_addr 0 instead of the block it synced (see
// vmstate's copyPaused), so guest writes made after a page was copied can
// be lost; with the box's RAM first none are
// (docs/design.md#dirty-tracking-under-tcg). A RAM size QEMU syncs page by
// page (not a multiple of 256 KiB) is correct too, but its first sync
// re-arms the TLBs once per page under the big lock, seconds for a few
// GiB.
//
// libvirt offers no way to leave out its backend, so on TCG hosts kvbox
// names a small wrapper as the domain's <emulator>: it runs the host's QEMU
// with the same arguments, less libvirt's "pc.ram" object when kvbox's
// backend is there (every other command line, libvirt's capability probe
// among them, goes through untouched). The snapshot code checks the RAM
// layout itself (QMP "info ramblock") before it copies live on TCG, so a
// box without the wrapper (an operator's template, a box made before it)
// is still copied while paused. A host with a MAC security driver
// (AppArmor, SELinux) confines QEMU to its own binary: there boxes name
// QEMU directly and stay on the paused copy.

// EmulatorWrapperPath is where kvbox keeps the wrapper.
func (h *Host) EmulatorWrapperPath() string {
	return h.Layout().Emulator()
}

// emulatorWrapper is the wrapper's text for the given QEMU binary. POSIX
// sh: `for a do shift; ... set -- "$@" "$a"; done` rebuilds the argument
// list in place, so no argument is ever split or globbed.
func emulatorWrapper(qemu string) []byte {
	return []byte(`#!/bin/sh
# Written by kvbox (domain/emulator.go). libvirt runs this as the emulator of
# kvbox's boxes on a TCG host: it runs QEMU with libvirt's arguments, less
# libvirt's own RAM backend ("pc.ram") when kvbox's (kvbox.ram) replaces it,
# so that kvbox's RAM is QEMU's first RAM block. Other command lines go
# through untouched.
qemu='` + strings.ReplaceAll(qemu, "'", `'\''`) + `'
case " $* " in
*" memory-backend=` + RAMBackendID + ` "*) ;;
*) exec "$qemu" "$@" ;;
esac
obj=
for a do
	shift
	if [ -n "$obj" ]; then
		obj=
		case $a in
		*'"id":"pc.ram"'*) continue ;;
		esac
		set -- "$@" -object "$a"
		continue
	fi
	if [ "$a" = -object ]; then
		obj=1
		continue
	fi
	set -- "$@" "$a"
done
if [ -n "$obj" ]; then
	set -- "$@" -object
fi
exec "$qemu" "$@"
`)
}

// Emulator is the <emulator> a new box names: the wrapper (written or
// brought up to date first) on a TCG host without a MAC security driver,
// else "" (libvirt's default QEMU).
func (h *Host) Emulator() (string, error) {
	typ, err := h.DomainType()
	if err != nil || typ != "qemu" {
		return "", err
	}
	f, err := h.hostFacts()
	if err != nil {
		return "", err
	}
	if f.macSecurity || f.qemu == "" {
		return "", nil
	}
	if err := h.writeEmulatorWrapper(f.qemu); err != nil {
		return "", err
	}
	return h.EmulatorWrapperPath(), nil
}

// EnsureEmulator writes the wrapper if the domain XML names it (a clone of
// a snapshot pulled from another host, a box whose wrapper was removed):
// libvirt would otherwise refuse to start it.
func (h *Host) EnsureEmulator(domainXML string) error {
	if !strings.Contains(domainXML, "<emulator>"+h.EmulatorWrapperPath()+"</emulator>") {
		return nil
	}
	f, err := h.hostFacts()
	if err != nil {
		return err
	}
	if f.qemu == "" {
		return base.Errorf(base.Invalid, "the box names kvbox's emulator wrapper, and libvirt reports no x86_64 QEMU on this host")
	}
	return h.writeEmulatorWrapper(f.qemu)
}

// writeEmulatorWrapper writes the wrapper (root's, 0755: QEMU's user runs
// it) unless it is there already as it should be.
func (h *Host) writeEmulatorWrapper(qemu string) error {
	path := h.EmulatorWrapperPath()
	want := emulatorWrapper(qemu)
	if got, err := os.ReadFile(path); err == nil && bytes.Equal(got, want) {
		if fi, err := os.Lstat(path); err == nil && fi.Mode() == 0o755 && fi.Mode().IsRegular() {
			return nil
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := os.Chmod(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return overlay.WriteFileAtomic(path, want, 0o755)
}

var (
	// the host's x86_64 QEMU in libvirt's capabilities
	qemuEmulatorRE = regexp.MustCompile(`(?s)<arch name='x86_64'>.*?<emulator>([^<]+)</emulator>`)
	// a security model that confines QEMU (not "none" or "dac")
	macModelRE = regexp.MustCompile(`<secmodel>\s*<model>(apparmor|selinux)</model>`)
)
