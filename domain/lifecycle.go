package domain

import (
	"context"
	"errors"
	"fmt"
	"html"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/revert"
	"kvbox.dev/kvbox/step"
)

// Boot is what a new box boots from: a base disk, and a kernel for direct
// boot when the image has one.
type Boot struct {
	Image       string // the image's name, recorded in the box's metadata
	Disk        string // base disk; the box's disk is a qcow2 overlay on it
	DiskFormat  string
	VirtualSize int64
	Kernel      string
	Initrd      string
	Cmdline     string
}

// Spec is a box to create.
type Spec struct {
	Name        string
	CPUs        int
	MemoryBytes int64
	DiskBytes   int64
	Boot        Boot
	// AgentTimeout bounds the wait for the agent's first answer.
	AgentTimeout time.Duration
	// NoNetwork: the box has no network interface at all (--network
	// none); its agent still works over its own channel.
	NoNetwork bool
	// Group puts the box in a box group (--network group:NAME): on the
	// group's bridge, made with its first box, where its boxes reach each
	// other and nothing else that isolated boxes cannot reach.
	Group string
	// Labels go in the box's metadata from its definition on (Meta.Labels).
	Labels []Label
	// Egress is the box's egress policy (Meta.Egress), in force from its
	// first packet; nil: none.
	Egress *egress.Policy
}

// Validate checks a spec before anything is created.
func (s Spec) Validate() error {
	if err := base.ValidName(s.Name); err != nil {
		return err
	}
	switch {
	case s.CPUs < 1 || s.CPUs > 256:
		return base.Errorf(base.Invalid, "--cpus %d: a box has between 1 and 256 vCPUs", s.CPUs)
	case s.MemoryBytes < 64<<20:
		return base.Errorf(base.Invalid, "--memory %s: a box needs at least 64 MB", base.FormatSize(s.MemoryBytes))
	case s.MemoryBytes%(2<<20) != 0:
		return base.Errorf(base.Invalid, "--memory %s: give a multiple of 2 MB", base.FormatSize(s.MemoryBytes))
	case s.DiskBytes < s.Boot.VirtualSize:
		return base.Errorf(base.Invalid, "--disk %s is smaller than image %s (%s)", base.FormatSize(s.DiskBytes), s.Boot.Image, base.FormatSize(s.Boot.VirtualSize))
	}
	return nil
}

// RAMBackendID is the id of the memory backend that holds a box's RAM; it is
// also the RAM block's name in QEMU's migration stream, which a clone's
// mapping of a snapshot must match.
const RAMBackendID = "kvbox.ram"

// RAMArgs are the QEMU arguments that give a box's RAM kvbox's own backend
// (RAMBackendID): anonymous memory, private to QEMU. Nothing of the
// guest's RAM is in a file while it runs, a page it never touched costs
// no host memory, and a live snapshot reads such a page as the kernel's
// zero page (in a shared file it costs a zeroed page of page cache:
// docs/design.md#live-copy-of-ram). libvirt has no element for a backend id of kvbox's choosing;
// QEMU merges the second -machine over libvirt's own.
func RAMArgs(size int64) []string {
	return []string{
		"-object", fmt.Sprintf("memory-backend-ram,id=%s,size=%d", RAMBackendID, size),
		"-machine", "memory-backend=" + RAMBackendID,
	}
}

// ReplaceQemuArg replaces the qemu:arg value old, found exactly once in a
// domain XML (HTML-escaped as libvirt writes it, or raw), by repl; false
// when it is not there once.
func ReplaceQemuArg(xml, old, repl string) (string, bool) {
	for _, o := range []string{html.EscapeString(old), old} {
		if strings.Count(xml, o) == 1 {
			return strings.Replace(xml, o, html.EscapeString(repl), 1), true
		}
	}
	return xml, false
}

// SplitQemuOpts splits a QEMU option string at single commas (",," is an
// escaped comma).
func SplitQemuOpts(s string) []string {
	var parts []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == ',' {
			if i+1 < len(s) && s[i+1] == ',' {
				cur.WriteByte(',')
				i++
				continue
			}
			parts = append(parts, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteByte(s[i])
	}
	return append(parts, cur.String())
}

// BalloonAlias is the alias of a box's balloon (templates/box.xml), whose
// properties kvbox overrides.
const BalloonAlias = "balloon0"

// QemuOptEscape doubles commas, QEMU's escape inside an option value.
func QemuOptEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// Create defines and starts a new box, waits for its agent and gives the
// guest its identity: the box plan (Creation.Plan) run with a define step
// that makes an overlay on the image's disk. On any failure everything it
// created is removed.
func (h *Host) Create(ctx context.Context, s Spec) (Box, error) {
	b, _, err := h.CreateTimed(ctx, s)
	return b, err
}

// CreateTimed is Create, also returning the time of each step.
func (h *Host) CreateTimed(ctx context.Context, s Spec) (Box, step.Timings, error) {
	if err := s.Validate(); err != nil {
		return Box{}, nil, err
	}
	if s.Group != "" && s.NoNetwork {
		return Box{}, nil, base.Errorf(base.Invalid, "a box without network is in no group")
	}
	if err := h.EnsureNetwork(); err != nil {
		return Box{}, nil, err
	}
	c := &Creation{Host: h, Name: s.Name, AgentTimeout: s.AgentTimeout}
	return c.Run(ctx, c.Plan(func(ctx context.Context, c *Creation, r *revert.Reverter) error {
		return h.define(ctx, c, s, r)
	}))
}

// define reserves an address and a folder, makes the box's disk (an overlay
// on the image's) and defines the domain, which then holds the address in
// its metadata. It runs under the host lock.
func (h *Host) define(ctx context.Context, c *Creation, s Spec, r *revert.Reverter) (err error) {
	nc, err := h.GroupNetwork(s.Group)
	if err != nil {
		return err
	}
	if c.Res, err = h.Reserve(s.Name, nc, r); err != nil {
		return err
	}
	dir := c.Res.Dir
	disk := filepath.Join(dir, DiskFile)
	if err := overlay.CreateLarger(ctx, disk, s.Boot.Disk, s.Boot.DiskFormat, max(s.DiskBytes, s.Boot.VirtualSize)); err != nil {
		return err
	}
	// QEMU writes the box's own disk; libvirt chowns nothing (DACLabel).
	if err := h.ChownForQEMU(disk); err != nil {
		return err
	}
	typ, err := h.DomainType()
	if err != nil {
		return err
	}
	meta := Meta{
		Image: s.Boot.Image, IP: c.Res.IP.String(), Prefix: nc.Subnet.Bits(), Gateway: nc.Gateway().String(),
		MAC: network.NewMAC(), Bridge: nc.Bridge, Group: s.Group, Dir: dir, DiskBytes: max(s.DiskBytes, s.Boot.VirtualSize),
		Transport: Transport(), Created: time.Now().UTC().Truncate(time.Second), Labels: s.Labels, Egress: s.Egress,
	}
	if s.NoNetwork {
		if s.Egress != nil {
			return base.Errorf(base.Invalid, "--egress with --network none: a box without network sends nothing a policy could judge")
		}
		meta.IP, meta.Prefix, meta.Gateway, meta.MAC, meta.Bridge = "", 0, "", "", ""
	}
	xml, err := h.render(typ, s.Name, meta, s.CPUs, s.MemoryBytes, disk, s.Boot, RAMArgs(s.MemoryBytes))
	if err != nil {
		return err
	}
	if c.Dom, err = h.Conn().DomainDefineXML(xml); err != nil {
		return fmt.Errorf("define box %q: %s", s.Name, LibvirtMessage(err))
	}
	r.Add(func() { Undefine(c.Dom) })
	return c.Reread()
}

// Reservation is a box being created: its address and folder. Until Done,
// a marker lock in the folder says a live kvbox is still at it; RecoverBoxes
// removes what a kvbox killed half-way left.
type Reservation struct {
	IP     netip.Addr
	Dir    string
	marker *base.FileLock
}

// Done marks the box as complete.
func (r Reservation) Done() { r.marker.RemoveAndUnlock() }

// creatingMarker is the lock file in a folder of a box being created.
const creatingMarker = ".creating.lock"

// Reserve checks that no domain has the name, picks a free address on nc
// (the main network or a group's) and makes the box's folder (given to
// QEMU's user), adding its removal to r.
// Call it under Lock and define the domain before unlocking: the domain's
// metadata is what holds the address. Call Done once the box is complete.
func (h *Host) Reserve(name string, nc network.Config, r *revert.Reverter) (Reservation, error) {
	if err := h.NameFree(name); err != nil {
		return Reservation{}, err
	}
	used, err := h.UsedAddrs()
	if err != nil {
		return Reservation{}, err
	}
	ip, err := nc.Allocate(used)
	if err != nil {
		return Reservation{}, err
	}
	nc.ForgetNeighbor(ip)
	dir := h.Layout().Box(name)
	// No domain has this name, so a folder left here is debris of a kvbox
	// that was killed half-way; it holds nothing of value.
	os.RemoveAll(dir)
	if err := os.MkdirAll(h.Layout().Boxes(), 0o755); err != nil {
		return Reservation{}, err
	}
	if err := os.Mkdir(dir, 0o750); err != nil {
		return Reservation{}, err
	}
	r.Add(func() { os.RemoveAll(dir) })
	r.Add(func() { h.keepConsoleLog(name, dir) })
	marker, err := base.CreateLocked(filepath.Join(dir, creatingMarker))
	if err != nil {
		return Reservation{}, err
	}
	r.Add(marker.Unlock)
	if err := h.ChownForQEMU(dir); err != nil {
		return Reservation{}, err
	}
	return Reservation{IP: ip, Dir: dir, marker: marker}, nil
}

// keepConsoleLog saves the console log of a box whose creation failed
// before its folder goes: it tells why the guest never answered.
func (h *Host) keepConsoleLog(name, dir string) {
	// The box folder is writable by QEMU: never follow a link planted there
	// (root would copy any host file into logs/).
	b, err := readNoFollow(filepath.Join(dir, "console.log"))
	if err != nil {
		return
	}
	if os.MkdirAll(filepath.Dir(h.Layout().FailedConsoleLog(name)), 0o700) == nil {
		os.WriteFile(h.Layout().FailedConsoleLog(name), b, 0o600)
	}
}

// RecoverBoxes removes boxes whose creation a killed kvbox left half-done:
// the domain (destroyed and undefined) and the folder, and with them the
// address. Boxes a live kvbox is still creating are left alone. It returns
// the names it removed.
func (h *Host) RecoverBoxes() ([]string, error) {
	ents, err := os.ReadDir(h.Layout().Boxes())
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var removed []string
	var errs []error
	for _, e := range ents {
		dir := filepath.Join(h.Layout().Boxes(), e.Name())
		path := filepath.Join(dir, creatingMarker)
		// Never LockFile here: it creates the file, and a marker that a
		// finished creation has just removed would come back, locked by
		// us, over a box that is complete.
		l, err := base.LockExisting(path)
		if err != nil {
			continue // no marker, or a live kvbox is creating the box
		}
		if d, err := h.Conn().LookupDomainByName(e.Name()); err == nil {
			if b, ok, _ := boxOf(d); ok && b.Dir == dir {
				powerOff(d, e.Name())
				if err := Undefine(d); err != nil && !isNoDomain(err) {
					errs = append(errs, fmt.Errorf("remove half-created box %q: %s", e.Name(), LibvirtMessage(err)))
					d.Free()
					l.Unlock()
					continue
				}
				h.ForgetPort(b)
			}
			d.Free()
		}
		l.Unlock()
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, e.Name())
	}
	return removed, errors.Join(errs...)
}

// removingMarker, in a box folder, says kvbox is removing the box.
const removingMarker = ".removing"

// RemoveOrphanFolders removes the folders of boxes whose removal a killed
// kvbox left half-done (the domain undefined, the folder still there), and
// returns their names. A folder without the marker is left alone even with
// no domain: an operator may have undefined the domain to define it again.
func (h *Host) RemoveOrphanFolders(ctx context.Context) []string {
	ents, _ := os.ReadDir(h.Layout().Boxes())
	var removed []string
	for _, e := range ents {
		dir := filepath.Join(h.Layout().Boxes(), e.Name())
		if fi, err := os.Lstat(filepath.Join(dir, removingMarker)); e.IsDir() && err == nil && fi.Mode().IsRegular() && h.removeOrphan(ctx, e.Name(), dir) {
			removed = append(removed, e.Name())
		}
	}
	return removed
}

// removeOrphan removes one such folder, checking again under the host
// lock, which every creation holds from making its folder to defining its
// domain.
func (h *Host) removeOrphan(ctx context.Context, name, dir string) bool {
	owned := func() bool {
		d, err := h.Conn().LookupDomainByName(name)
		if err != nil {
			return !isNoDomain(err) // when in doubt, it is somebody's
		}
		d.Free()
		return true
	}
	if owned() {
		return false
	}
	unlock, err := h.Lock(ctx)
	if err != nil {
		return false
	}
	defer unlock()
	if _, err := os.Lstat(filepath.Join(dir, creatingMarker)); !errors.Is(err, os.ErrNotExist) || owned() {
		return false
	}
	return os.RemoveAll(dir) == nil
}

// Testpoint lets end-to-end tests kill kvbox at a named step
// (KVBOX_TEST_KILL_AT=step) to prove a crash there loses nothing.
func Testpoint(name string) { step.KillPoint(name) }

// render fills the domain template.
func (h *Host) render(typ, name string, meta Meta, cpus int, mem int64, disk string, boot Boot, qemuArgs []string) (string, error) {
	md, err := MarshalMeta(meta)
	if err != nil {
		return "", err
	}
	dac, err := h.DACLabel()
	if err != nil {
		return "", err
	}
	emulator, err := h.Emulator()
	if err != nil {
		return "", err
	}
	return Render(h.Template, TemplateData{
		Type: typ, Emulator: emulator, Name: name, Metadata: md, MemoryBytes: mem, CPUs: cpus,
		Kernel: boot.Kernel, Initrd: boot.Initrd, Cmdline: boot.Cmdline, Disk: disk,
		Bridge: meta.Bridge, Group: meta.Group, MAC: meta.MAC, IP: meta.IP, Tap: network.TapName(meta.MAC), ConsoleLog: filepath.Join(meta.Dir, "console.log"),
		AgentPorts: AgentSockets(meta.Dir), Vsock: meta.Transport == "vsock", QemuArgs: qemuArgs,
		DACLabel: dac,
	})
}

// Transport is how kvbox talks to agents on this host: vsock where the host
// has vhost-vsock, else virtio-serial.
func Transport() string {
	if _, err := os.Stat("/dev/vhost-vsock"); err == nil {
		return "vsock"
	}
	return "virtio-serial"
}

// LockedLookup takes the box's lock and looks the box up; release frees the
// domain and drops the lock.
func (h *Host) LockedLookup(ctx context.Context, name string) (b Box, dom *libvirt.Domain, release func(), err error) {
	l, err := h.lockBox(ctx, name)
	if err != nil {
		return Box{}, nil, nil, err
	}
	b, dom, err = h.Lookup(name)
	if err != nil {
		// No such box: its lock file guards nothing.
		l.RemoveAndUnlock()
		return Box{}, nil, nil, err
	}
	return b, dom, func() {
		dom.Free()
		d, err := h.Conn().LookupDomainByName(name)
		if err == nil {
			d.Free()
		}
		if isNoDomain(err) {
			l.RemoveAndUnlock() // the box was removed under the lock
			return
		}
		l.Unlock()
	}, nil
}

// powerOff pulls the plug of a running domain; one already off is fine.
func powerOff(dom *libvirt.Domain, name string) error {
	if err := dom.Destroy(); err != nil && !isNotRunning(err) {
		return fmt.Errorf("stop box %q: %s", name, LibvirtMessage(err))
	}
	return nil
}

// qemuPidDir is where libvirt's system QEMU driver keeps a running
// domain's pid file.
const qemuPidDir = "/run/libvirt/qemu"

// killQEMU sends SIGKILL to a box's QEMU before libvirt's destroy. libvirt
// (virProcessKillPainfully) sends SIGTERM and then polls every 200 ms until
// the process is gone; QEMU's orderly exit on SIGTERM under TCG takes a
// poll or more. A box being removed has nothing to flush: its disk and RAM
// are deleted next. It is best effort: the pid must be that of a QEMU whose
// command line names this domain (guest=NAME), else nothing is sent and
// the destroy that follows does the whole work.
//
// It then waits (up to 2 s) until the process is gone, reaped by its
// parent: libvirt's destroy checks with kill(pid, 0), which succeeds on an
// exiting process or a zombie, and then sleeps 200 ms before it looks again.
func killQEMU(name string) {
	pid := qemuPID(name)
	if pid == 0 || syscall.Kill(pid, syscall.SIGKILL) != nil {
		return
	}
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		if syscall.Kill(pid, 0) == syscall.ESRCH {
			return
		}
	}
}

// Start boots a stopped box and waits until its agent answers.
func (h *Host) Start(ctx context.Context, name string, timeout time.Duration) (Box, error) {
	b, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return Box{}, err
	}
	defer release()
	if !b.State.Bootable() {
		return Box{}, base.Errorf(base.Busy, "box %q is %s, not stopped", name, b.State)
	}
	if err := h.EnsureBoxNetwork(b); err != nil {
		return Box{}, err
	}
	if err := h.AllowPort(b); err != nil {
		return Box{}, err
	}
	// A box resumed from a suspend mapped its RAM from the saved state; a
	// cold boot needs none of it.
	RemoveSuspendStates(b.Dir, nil)
	// The box plan without define. A box whose agent does not answer is
	// left running, for its console to tell why.
	c := &Creation{Host: h, Name: name, AgentTimeout: timeout, Dom: dom, Box: b, borrowed: true}
	p := c.Plan(nil).Replace("define").Replace("start", step.Step{Name: "start", Do: c.start})
	b, _, err = c.Run(ctx, p)
	return b, err
}

// Stop shuts a box down through ACPI, and pulls the plug after timeout (or
// at once with force).
func (h *Host) Stop(ctx context.Context, name string, timeout time.Duration, force bool) error {
	b, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return err
	}
	defer release()
	if b.State == StateStopped {
		return nil
	}
	if b.State == StateSuspended {
		return base.Errorf(base.Busy, "box %q is suspended, not running (kvbox resume %s wakes it, kvbox rm %s deletes it)", name, name, name)
	}
	if !force {
		if err := dom.Shutdown(); err == nil && waitState(ctx, dom, libvirt.DOMAIN_SHUTOFF, timeout) {
			return nil
		}
	}
	return powerOff(dom, name)
}

// Remove deletes a box: its domain, folder (disk, memory, sockets) and with
// them its address. A running box is only removed with force.
func (h *Host) Remove(ctx context.Context, name string, force bool) error {
	return h.RemoveIf(ctx, name, force, nil)
}

// RemoveIf is Remove of the box called name as it is under its lock: check
// (nil: none) gets it before anything changes, and an error from it leaves
// the box as it is. A TTL removes the box that expired, not whatever box
// has its name by then (IsBox).
func (h *Host) RemoveIf(ctx context.Context, name string, force bool, check func(Box) error) error {
	b, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return err
	}
	defer release()
	if check != nil {
		if err := check(b); err != nil {
			return err
		}
	}
	if !b.State.NoQEMU() {
		if !force {
			return base.Errorf(base.Busy, "box %q is %s; stop it first or use --force", name, b.State)
		}
		killQEMU(name)
		if err := powerOff(dom, name); err != nil {
			return err
		}
	}
	// A kvbox killed from here until the folder is gone leaves this
	// marker: the next command removes the folder (RemoveOrphanFolders).
	if b.Dir != "" && filepath.Dir(b.Dir) == h.Layout().Boxes() {
		if f, err := os.OpenFile(filepath.Join(b.Dir, removingMarker), os.O_CREATE|os.O_WRONLY|syscall.O_NOFOLLOW, 0o600); err == nil {
			f.Close()
		}
	}
	if err := Undefine(dom); err != nil {
		return fmt.Errorf("undefine box %q: %s", name, LibvirtMessage(err))
	}
	// Best effort: the box is gone either way; its port filter entry
	// names a tap no other box can have (its MAC's).
	portErr := h.ForgetPort(b)
	h.RemoveSuspendFiles(name)
	if b.Dir != "" && filepath.Dir(b.Dir) == h.Layout().Boxes() {
		if err := os.RemoveAll(b.Dir); err != nil {
			return err
		}
	}
	os.Remove(h.Layout().QMPLog(name))
	os.Remove(h.Layout().QMPLog(name) + ".1")
	if b.Group != "" && portErr == nil {
		// A group's network goes with its last box.
		portErr = h.PruneGroups(ctx)
	}
	if portErr != nil {
		return fmt.Errorf("box %q is removed, but: %w", name, portErr)
	}
	return nil
}

// Undefine removes a domain's definition with whatever libvirt keeps beside it.
func Undefine(dom *libvirt.Domain) error {
	err := dom.UndefineFlags(libvirt.DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.DOMAIN_UNDEFINE_SNAPSHOTS_METADATA |
		libvirt.DOMAIN_UNDEFINE_CHECKPOINTS_METADATA | libvirt.DOMAIN_UNDEFINE_NVRAM)
	var le libvirt.Error
	if errors.As(err, &le) && le.Code == libvirt.ERR_INVALID_ARG && strings.Contains(le.Message, "unsupported flags") {
		// A driver without checkpoints or NVRAM (libvirt's test driver)
		// has none to remove.
		err = dom.UndefineFlags(libvirt.DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.DOMAIN_UNDEFINE_SNAPSHOTS_METADATA)
	}
	return err
}

func isNotRunning(err error) bool {
	var le libvirt.Error
	return errors.As(err, &le) && le.Code == libvirt.ERR_OPERATION_INVALID
}

// waitState polls until the domain reaches state or timeout passes.
func waitState(ctx context.Context, dom *libvirt.Domain, want libvirt.DomainState, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if st, _, err := dom.GetState(); err == nil && st == want {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(100 * time.Millisecond):
		}
	}
	return false
}

// RemoveSuspendStates deletes the saved states of suspends
// (suspend-*.state) in a box folder, but those keep says to keep (nil:
// none).
func RemoveSuspendStates(dir string, keep func(path string) bool) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		n := e.Name()
		if p := filepath.Join(dir, n); strings.HasPrefix(n, "suspend-") && strings.HasSuffix(n, ".state") && (keep == nil || !keep(p)) {
			os.Remove(p)
		}
	}
}

// Unpause continues a paused box (one a failed or interrupted snapshot left
// paused): the guest carries on where it stopped.
func (h *Host) Unpause(ctx context.Context, name string) (Box, error) {
	b, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return Box{}, err
	}
	defer release()
	if b.State != StatePaused {
		return Box{}, base.Errorf(base.Busy, "box %q is %s, not paused", name, b.State)
	}
	if err := dom.Resume(); err != nil {
		return Box{}, fmt.Errorf("continue box %q: %s", name, LibvirtMessage(err))
	}
	b.State = StateRunning
	return b, nil
}

// Wake wakes a box whose guest put itself to sleep (ACPI S3, libvirt's
// pmsuspended): its QEMU runs on, and the guest continues from where it
// slept.
func (h *Host) Wake(ctx context.Context, name string) (Box, error) {
	b, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return Box{}, err
	}
	defer release()
	if b.State != StatePMSuspended {
		return Box{}, base.Errorf(base.Busy, "box %q is %s, not asleep (pmsuspended)", name, b.State)
	}
	if err := dom.PMWakeup(0); err != nil {
		return Box{}, fmt.Errorf("wake box %q: %s", name, LibvirtMessage(err))
	}
	b.State = StateRunning
	return b, nil
}
