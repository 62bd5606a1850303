package qmp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/testenv/gate"
)

// TestDomainMonitor runs commands through libvirt's monitor on a transient,
// diskless, network-less domain of its own. It skips when no libvirtd answers
// on qemu:///system (testenv/setup.sh starts one).
func TestDomainMonitor(t *testing.T) {
	gate.Long(t)
	gate.LibvirtSocket(t)
	conn, err := libvirt.NewConnect("qemu:///system")
	if err != nil {
		t.Fatalf("libvirtd: %v", err)
	}
	defer conn.Close()
	typ := "qemu"
	if _, err := os.Stat("/dev/kvm"); err == nil {
		typ = "kvm"
	}
	name := fmt.Sprintf("kvbox-qmp-test-%d", os.Getpid())
	xml := fmt.Sprintf(`<domain type='%s'>
  <name>%s</name>
  <memory unit='MiB'>64</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices><memballoon model='none'/></devices>
</domain>`, typ, name)
	// AUTODESTROY: the domain goes away with this connection, even if the
	// test dies.
	dom, err := conn.DomainCreateXML(xml, libvirt.DOMAIN_START_AUTODESTROY|libvirt.DOMAIN_START_PAUSED)
	if err != nil {
		t.Fatalf("start domain: %v", err)
	}
	defer func() {
		dom.Destroy()
		dom.Free()
	}()

	c := NewDomainClient(dom)
	c.Timeout = 10 * time.Second
	ctx := context.Background()
	// Started paused, QEMU reports "prelaunch" (libvirt passes -S).
	if s, err := c.QueryStatus(ctx); err != nil || s.Running {
		t.Fatalf("status %+v, %v", s, err)
	}
	// libvirt hands QEMU's error reply back verbatim: the class survives.
	err = c.Execute(ctx, "no-such-command", nil, nil)
	if !errors.Is(err, ErrCommandNotFound) {
		t.Fatalf("unknown command through libvirt: %v", err)
	}
	before, err := c.QueryMigrateCapabilities(ctx)
	if err != nil {
		t.Fatal(err)
	}
	restore, err := c.ApplyMigrationSettings(ctx, map[string]bool{CapIgnoreShared: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if caps, _ := c.QueryMigrateCapabilities(ctx); !caps[CapIgnoreShared] {
		t.Fatal("x-ignore-shared not set through libvirt")
	}
	if err := restore(ctx); err != nil {
		t.Fatal(err)
	}
	after, err := c.QueryMigrateCapabilities(ctx)
	if err != nil || fmt.Sprint(after) != fmt.Sprint(before) {
		t.Fatalf("capabilities not restored: %v", err)
	}
	if err := c.Cont(ctx); err != nil {
		t.Fatal(err)
	}
	if s, err := c.QueryStatus(ctx); err != nil || !s.Running {
		t.Fatalf("status after cont %+v, %v", s, err)
	}
	if _, err := NewDomainMonitor(dom).Events(ctx); !errors.Is(err, ErrEventsViaLibvirt) {
		t.Fatalf("Events: %v", err)
	}
}
