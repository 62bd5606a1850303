package snapshot

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/qmp"
	"kvbox.dev/kvbox/revert"
)

// CloneTiming is where the time of one clone went, step by step.
type CloneTiming struct {
	Define     time.Duration // lock, address, folder, overlay, domain XML, define
	Start      time.Duration // libvirt starts QEMU paused (-incoming defer)
	ClosePort  time.Duration // the tap leaves the bridge
	Load       time.Duration // migrate-incoming of the state file, until completed
	Resume     time.Duration // capabilities restored, vCPUs running
	Agent      time.Duration // until the agent answers a ping
	Reidentify time.Duration // hostname, MAC, address, clock, entropy
	OpenPort   time.Duration // the tap joins the bridge
	Persist    time.Duration // the definition for the next cold boot
	Total      time.Duration
}

// String prints the steps in order, in milliseconds.
func (t CloneTiming) String() string {
	ms := func(d time.Duration) string { return fmt.Sprintf("%.0fms", float64(d.Microseconds())/1000) }
	return strings.Join([]string{
		"define " + ms(t.Define), "start " + ms(t.Start), "close-port " + ms(t.ClosePort),
		"load " + ms(t.Load), "resume " + ms(t.Resume), "agent " + ms(t.Agent),
		"reidentify " + ms(t.Reidentify), "open-port " + ms(t.OpenPort), "persist " + ms(t.Persist), "total " + ms(t.Total),
	}, ", ")
}

// CloneDisk is the clone's disk in its folder: a qcow2 overlay on the
// snapshot's disk.
const CloneDisk = "disk.qcow2"

// Clone starts a warm clone of snap named name: a new domain whose RAM maps
// the snapshot's memory privately, whose disk is an overlay on the
// snapshot's disk, and whose CPU and device state is loaded from the
// snapshot's state file. The clone is re-identified through its agent
// (hostname, MAC, address, clock, entropy) while its bridge port is
// closed; only then does the port open. On any failure, agent timeout
// included, everything created is removed and the address is free again.
func Clone(ctx context.Context, h *domain.Host, snap Snapshot, name string, agentTimeout time.Duration) (domain.Box, CloneTiming, error) {
	var tm CloneTiming
	t0 := time.Now()
	step := func(d *time.Duration) {
		now := time.Now()
		*d = now.Sub(t0) - tm.sum()
	}
	if err := domain.ValidName(name); err != nil {
		return domain.Box{}, tm, err
	}
	if agentTimeout <= 0 {
		agentTimeout = 60 * time.Second
	}
	srcXML, err := os.ReadFile(snap.Path(DomainXMLFile))
	if err != nil {
		return domain.Box{}, tm, fmt.Errorf("snapshot %q: %w", snap.Name, err)
	}
	if err := h.Net.Ensure(); err != nil {
		return domain.Box{}, tm, err
	}

	r := revert.New()
	dom, meta, spec, res, err := defineClone(ctx, h, snap, name, string(srcXML), r)
	if err != nil {
		r.Fail()
		return domain.Box{}, tm, err
	}
	defer dom.Free()
	defer r.Fail() // runs before Free: the undo steps use dom
	step(&tm.Define)

	domain.Testpoint("clone-defined")
	if err := dom.CreateWithFlags(libvirt.DOMAIN_START_PAUSED); err != nil {
		return domain.Box{}, tm, fmt.Errorf("start clone %q: %s", name, domain.LibvirtMessage(err))
	}
	r.Add(func() { dom.Destroy() })
	step(&tm.Start)

	// Not one frame of the clone may reach the bridge before it is
	// re-identified: the restored guest still believes it is the source
	// (gratuitous ARP with the source's MAC and IP), and QEMU announces
	// when the incoming migration ends.
	live, err := dom.GetXMLDesc(0)
	if err != nil {
		return domain.Box{}, tm, fmt.Errorf("read clone %q: %s", name, domain.LibvirtMessage(err))
	}
	tap, err := liveTap(live)
	if err != nil {
		return domain.Box{}, tm, err
	}
	if err := network.ClosePort(tap); err != nil {
		return domain.Box{}, tm, err
	}
	step(&tm.ClosePort)
	domain.Testpoint("clone-port-closed")

	if err := loadState(ctx, dom, snap); err != nil {
		return domain.Box{}, tm, fmt.Errorf("load snapshot %q into clone %q: %w", snap.Name, name, err)
	}
	step(&tm.Load)
	if err := dom.Resume(); err != nil {
		return domain.Box{}, tm, fmt.Errorf("resume clone %q: %s", name, domain.LibvirtMessage(err))
	}
	step(&tm.Resume)
	domain.Testpoint("clone-resumed")

	b := domain.Box{Name: name, State: "running", Meta: meta, Tap: tap}
	// The machine-id comes from the clone's own UUID, which libvirt
	// picked at define.
	if b.UUID, err = dom.GetUUIDString(); err != nil {
		return domain.Box{}, tm, fmt.Errorf("read the UUID of clone %q: %s", name, domain.LibvirtMessage(err))
	}
	actx, cancel := context.WithTimeout(ctx, agentTimeout)
	defer cancel()
	c, err := h.WaitAgent(actx, dom, b)
	if err != nil {
		return domain.Box{}, tm, fmt.Errorf("clone %q of snapshot %q: %w", name, snap.Name, err)
	}
	defer c.Close()
	step(&tm.Agent)
	if err := h.Reidentify(actx, c, b); err != nil {
		return domain.Box{}, tm, err
	}
	step(&tm.Reidentify)
	if err := h.Net.OpenPort(tap); err != nil {
		return domain.Box{}, tm, err
	}
	step(&tm.OpenPort)
	// The running clone was started from a definition that maps the
	// snapshot and waits for -incoming: its next cold boot must not.
	spec.UUID, spec.BootRAM = b.UUID, domain.MemoryFile(meta.Dir)
	boot, err := CloneXML(string(srcXML), spec)
	if err != nil {
		return domain.Box{}, tm, err
	}
	if d2, err := h.Conn.DomainDefineXML(boot); err != nil {
		return domain.Box{}, tm, fmt.Errorf("define clone %q for its next boot: %s", name, domain.LibvirtMessage(err))
	} else {
		d2.Free()
	}
	step(&tm.Persist)
	r.Success()
	res.Done()
	tm.Total = time.Since(t0)
	out, err := h.Get(name)
	if err != nil {
		return domain.Box{}, tm, err
	}
	return out, tm, nil
}

func (t CloneTiming) sum() time.Duration {
	return t.Define + t.Start + t.ClosePort + t.Load + t.Resume + t.Agent + t.Reidentify + t.OpenPort + t.Persist
}

// defineClone does the part of Clone that needs the host lock: pick a free
// address, make the folder and overlay, and define the domain, which then
// holds the address in its metadata.
func defineClone(ctx context.Context, h *domain.Host, snap Snapshot, name, srcXML string, r *revert.Reverter) (*libvirt.Domain, domain.Meta, CloneXMLSpec, domain.Reservation, error) {
	unlock, err := h.Lock()
	if err != nil {
		return nil, domain.Meta{}, CloneXMLSpec{}, domain.Reservation{}, err
	}
	defer unlock()
	// The snapshot may have been deleted since it was read; under the lock
	// snapshots rm cannot delete it until this clone is defined.
	if _, err := os.Stat(snap.Path(MetaFile)); err != nil {
		return nil, domain.Meta{}, CloneXMLSpec{}, domain.Reservation{}, fmt.Errorf("snapshot %q is gone: %w", snap.Name, domain.ErrNotFound)
	}
	res, err := h.Reserve(name, r)
	if err != nil {
		return nil, domain.Meta{}, CloneXMLSpec{}, domain.Reservation{}, err
	}
	ip, dir := res.IP, res.Dir
	disk := filepath.Join(dir, CloneDisk)
	if err := overlay.Create(ctx, disk, snap.Path(DiskFile), "qcow2"); err != nil {
		return nil, domain.Meta{}, CloneXMLSpec{}, domain.Reservation{}, err
	}
	memFile := snap.Memory.File
	if memFile == "" {
		memFile = MemoryFile
	}
	meta := domain.Meta{
		Image: snap.Image, Snapshot: snap.Name, IP: ip.String(), Prefix: h.Net.Subnet.Bits(),
		Gateway: h.Net.Gateway().String(), MAC: network.NewMAC(), Bridge: h.Net.Bridge, Dir: dir,
		DiskBytes: snap.DiskBytes, Transport: domain.Transport(), Created: time.Now().UTC().Truncate(time.Second),
	}
	spec := CloneXMLSpec{
		Name: name, Meta: meta, Disk: disk,
		MemPath: snap.Path(memFile), MemOffset: snap.Memory.Offset, MemBytes: snap.MemoryBytes,
	}
	xml, err := CloneXML(srcXML, spec)
	if err != nil {
		return nil, domain.Meta{}, CloneXMLSpec{}, domain.Reservation{}, err
	}
	dom, err := h.Conn.DomainDefineXML(xml)
	if err != nil {
		return nil, domain.Meta{}, CloneXMLSpec{}, domain.Reservation{}, fmt.Errorf("define clone %q: %s", name, domain.LibvirtMessage(err))
	}
	r.Add(func() { domain.Undefine(dom) })
	return dom, meta, spec, res, nil
}

// loadState loads the snapshot's CPU and device state into the paused
// clone. x-ignore-shared makes QEMU skip RAM that lives in a named file;
// with mapped-ram, RAM sits at fixed offsets in the state file (a snapshot
// of a clone) and, its page bitmap being zeroed, none of it is read: the
// clone maps it. Both are put back afterwards: a box left
// with x-ignore-shared on writes RAM-less images on `virsh save`.
func loadState(ctx context.Context, dom *libvirt.Domain, snap Snapshot) error {
	c := qmp.NewDomainClient(dom)
	// The stream records which capabilities wrote it and QEMU refuses
	// a mismatch ("Capability x-ignore-shared is on, but received
	// capability is off"): a mapped-ram snapshot (of a clone, whose RAM
	// is private) was written without x-ignore-shared.
	caps := map[string]bool{qmp.CapIgnoreShared: true}
	if snap.Memory.MappedRAM {
		caps = map[string]bool{qmp.CapIgnoreShared: false, qmp.CapMappedRAM: true}
	}
	restore, err := c.ApplyMigrationSettings(ctx, caps, nil)
	if err != nil {
		return err
	}
	if err := c.MigrateIncoming(ctx, "file:"+snap.Path(StateFile)); err != nil {
		return errJoin(err, restore(ctx))
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := c.WaitMigration(wctx, 2*time.Millisecond); err != nil {
		return errJoin(err, restore(ctx))
	}
	return restore(ctx)
}

func errJoin(err, more error) error {
	if more == nil {
		return err
	}
	return fmt.Errorf("%w (and: %v)", err, more)
}
