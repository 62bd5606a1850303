// Package domain owns boxes as libvirt domains: their XML (rendered from a
// template, with kvbox's facts in the domain's metadata), their folders on
// the host, and their life cycle (create, start, stop, remove), including
// waiting for a box's guest agent and giving the guest its identity. It
// also holds kvbox's sentinel errors and name and size rules.
package domain

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"libvirt.org/go/libvirt"

	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/network"
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
	facts     *hostFacts
}

// BoxesDir holds one folder per box: disk overlay, memory file, agent
// sockets, console log.
func (h *Host) BoxesDir() string { return filepath.Join(h.StateDir, "boxes") }

// FailedConsoleLog is where the console log of a box whose creation failed
// is kept after its folder is removed: the next failure of that name
// replaces it.
func (h *Host) FailedConsoleLog(name string) string {
	return filepath.Join(h.StateDir, "logs", name+".console.log")
}

// BoxDir is the folder of the named box.
func (h *Host) BoxDir(name string) string { return filepath.Join(h.BoxesDir(), name) }

// Lock takes kvbox's host-wide lock, which serializes every change of
// which boxes exist and which addresses they hold: two `kvbox new` run at
// the same moment from two shells never pick the same address.
func (h *Host) Lock() (unlock func(), err error) {
	l, err := h.waitLock(filepath.Join(h.StateDir, "lock"))
	if err != nil {
		return nil, err
	}
	return l.Unlock, nil
}

// lockBox takes the lock of one box, held by commands that change it.
func (h *Host) lockBox(name string) (*FileLock, error) {
	return h.waitLock(filepath.Join(h.StateDir, "locks", name+".lock"))
}

// ErrInterrupted is returned by a lock wait that h.Interrupt ended.
var ErrInterrupted = errors.New("interrupted while waiting for a lock another kvbox holds")

// waitLock takes the lock at path, waiting for its holder; without
// h.Interrupt it blocks in flock, with it it polls so that the wait can end.
func (h *Host) waitLock(path string) (*FileLock, error) {
	if h.Interrupt == nil {
		return LockFile(path, true)
	}
	for {
		l, err := LockFile(path, false)
		if !errors.Is(err, ErrLocked) {
			return l, err
		}
		select {
		case <-h.Interrupt:
			return nil, fmt.Errorf("%w (%s)", ErrInterrupted, path)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// FileLock is an exclusive flock on a lock file.
type FileLock struct {
	f    *os.File
	path string
}

// ErrLocked is returned by LockFile without wait when another holds the lock.
var ErrLocked = errors.New("locked by another kvbox")

// LockFile locks path, creating it; without wait it fails with ErrLocked
// instead of waiting. Once locked, it checks that path still names the file
// it locked: a holder may remove the lock file on release (RemoveAndUnlock),
// and a kvbox that opened it just before must then try again rather than
// hold a lock on a file nobody else can see.
func LockFile(path string, wait bool) (*FileLock, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	how := syscall.LOCK_EX
	if !wait {
		how |= syscall.LOCK_NB
	}
	for {
		// 0600: a local user who could open the lock could also flock it
		// and block every kvbox command.
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, err
		}
		if err := f.Chmod(0o600); err != nil { // one an older kvbox made 0644
			f.Close()
			return nil, err
		}
		if err := syscall.Flock(int(f.Fd()), how); err != nil {
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				return nil, ErrLocked
			}
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		var held, now syscall.Stat_t
		if syscall.Fstat(int(f.Fd()), &held) == nil && syscall.Stat(path, &now) == nil && held.Ino == now.Ino && held.Dev == now.Dev {
			return &FileLock{f: f, path: path}, nil
		}
		f.Close()
	}
}

// createLocked makes a new lock file at path that is locked from the first
// moment anyone can see it: it is made and locked under another name, then
// renamed into place. (LockFile creates, then locks: another kvbox that
// locks it in between would take the file for one a dead kvbox left.)
func createLocked(path string) (*FileLock, error) {
	tmp := path + ".new"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_RDWR|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("lock %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		f.Close()
		os.Remove(tmp)
		return nil, err
	}
	return &FileLock{f: f, path: path}, nil
}

// lockExisting locks the lock file at path without waiting and without
// creating it: it fails when there is no such file, when another kvbox
// holds it (ErrLocked), or when the file was removed while it was being
// locked (its holder finished).
func lockExisting(path string) (*FileLock, error) {
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, ErrLocked
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	var held, now syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &held) != nil || syscall.Stat(path, &now) != nil || held.Ino != now.Ino || held.Dev != now.Dev {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, os.ErrNotExist)
	}
	return &FileLock{f: f, path: path}, nil
}

// Unlock releases the lock and keeps the lock file.
func (l *FileLock) Unlock() { l.f.Close() }

// RemoveAndUnlock deletes the lock file (what it guarded is gone) and
// releases the lock.
func (l *FileLock) RemoveAndUnlock() {
	os.Remove(l.path)
	l.f.Close()
}

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
// memory file and agent sockets in a box's folder.
func (h *Host) ChownForQEMU(path string) error {
	f, err := h.hostFacts()
	if err != nil || f.uid < 0 {
		return err
	}
	return os.Lchown(path, f.uid, f.gid)
}

// Box is one kvbox box as libvirt and its metadata describe it.
type Box struct {
	Name        string `json:"name"`
	UUID        string `json:"uuid"`
	State       string `json:"state"`
	Meta               // image or snapshot, ip, mac, ...
	CPUs        int    `json:"cpus"`
	MemoryBytes int64  `json:"memory_bytes"`
	VsockCID    uint32 `json:"vsock_cid,omitempty"`
	Tap         string `json:"tap,omitempty"`
}

// Addr is the box's address.
func (b Box) Addr() netip.Addr {
	a, _ := netip.ParseAddr(b.IP)
	return a
}

// From is the box's origin: its image, or the snapshot it was cloned from.
func (b Box) From() string {
	if b.Snapshot != "" {
		return "snapshot " + b.Snapshot
	}
	return "image " + b.Image
}

func stateName(s libvirt.DomainState) string {
	switch s {
	case libvirt.DOMAIN_RUNNING:
		return "running"
	case libvirt.DOMAIN_BLOCKED:
		return "blocked"
	case libvirt.DOMAIN_PAUSED:
		return "paused"
	case libvirt.DOMAIN_SHUTDOWN:
		return "shutting-down"
	case libvirt.DOMAIN_SHUTOFF:
		return "stopped"
	case libvirt.DOMAIN_CRASHED:
		return "crashed"
	case libvirt.DOMAIN_PMSUSPENDED:
		return "suspended"
	}
	return "unknown"
}

// boxOf reads a domain; ok is false when it is not a kvbox box.
func boxOf(d *libvirt.Domain) (b Box, ok bool, err error) {
	x, err := d.GetXMLDesc(0)
	if err != nil {
		return Box{}, false, fmt.Errorf("read domain XML: %w", err)
	}
	dx, err := parseDomainXML(x)
	if err != nil {
		return Box{}, false, err
	}
	if dx.Metadata == nil {
		return Box{}, false, nil
	}
	st, _, err := d.GetState()
	if err != nil {
		return Box{}, false, fmt.Errorf("read domain state: %w", err)
	}
	b = Box{Name: dx.Name, UUID: dx.UUID, State: stateName(st), Meta: *dx.Metadata, CPUs: dx.VCPU, MemoryBytes: dx.memoryBytes()}
	if dx.Devices.Vsock != nil {
		b.VsockCID = dx.Devices.Vsock.CID.Address
	}
	if len(dx.Devices.Interfaces) > 0 {
		b.Tap = dx.Devices.Interfaces[0].Target.Dev
	}
	return b, true, nil
}

// Boxes lists every box, sorted by name. Domains without kvbox metadata are
// not boxes and are left out.
func (h *Host) Boxes() ([]Box, error) {
	doms, err := h.Conn.ListAllDomains(0)
	if err != nil {
		return nil, fmt.Errorf("list domains: %s", LibvirtMessage(err))
	}
	var out []Box
	for i := range doms {
		b, ok, err := boxOf(&doms[i])
		doms[i].Free()
		if isNoDomain(err) {
			continue // removed while we looked
		}
		if err != nil {
			return nil, err
		}
		if ok {
			out = append(out, b)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// NoBoxError says no domain of that name exists (as opposed to a domain that
// is not a box); it wraps ErrNotFound.
type NoBoxError struct{ Name string }

func (e NoBoxError) Error() string {
	return fmt.Sprintf("box %q does not exist (kvbox ls lists boxes): %v", e.Name, ErrNotFound)
}

func (e NoBoxError) Unwrap() error { return ErrNotFound }

// Lookup returns the named box and its domain; the caller frees the domain.
func (h *Host) Lookup(name string) (Box, *libvirt.Domain, error) {
	if err := ValidName(name); err != nil {
		return Box{}, nil, err
	}
	d, err := h.Conn.LookupDomainByName(name)
	if isNoDomain(err) {
		return Box{}, nil, NoBoxError{name}
	}
	if err != nil {
		return Box{}, nil, fmt.Errorf("look up %q: %s", name, LibvirtMessage(err))
	}
	b, ok, err := boxOf(d)
	if err != nil {
		d.Free()
		return Box{}, nil, err
	}
	if !ok {
		d.Free()
		return Box{}, nil, fmt.Errorf("domain %q is not a kvbox box (it has no kvbox metadata): %w", name, ErrNotFound)
	}
	return b, d, nil
}

// Get returns the named box.
func (h *Host) Get(name string) (Box, error) {
	b, d, err := h.Lookup(name)
	if err != nil {
		return Box{}, err
	}
	d.Free()
	return b, nil
}

// UsedAddrs lists every address held by a box. Call it under Lock.
func (h *Host) UsedAddrs() ([]netip.Addr, error) {
	boxes, err := h.Boxes()
	if err != nil {
		return nil, err
	}
	var used []netip.Addr
	for _, b := range boxes {
		if a := b.Addr(); a.IsValid() {
			used = append(used, a)
		}
	}
	return used, nil
}

// NameFree reports ErrExists when a domain (a box or not) has the name.
func (h *Host) NameFree(name string) error {
	d, err := h.Conn.LookupDomainByName(name)
	if err == nil {
		d.Free()
		return fmt.Errorf("a box or domain named %q %w (pick another name, or kvbox rm %s)", name, ErrExists, name)
	}
	if !isNoDomain(err) {
		return fmt.Errorf("look up %q: %s", name, LibvirtMessage(err))
	}
	return nil
}

// AgentSockets are the host ends of a box's agent ports.
func AgentSockets(dir string) []AgentPort {
	var ps []AgentPort
	for i := range AgentPorts {
		ps = append(ps, AgentPort{
			Name: fmt.Sprintf("%s%d", agent.SerialPortPrefix, i),
			Path: filepath.Join(dir, fmt.Sprintf("agent.%d.sock", i)),
		})
	}
	return ps
}

// Dial connects to a box's agent over the box's transport.
func (h *Host) Dial(ctx context.Context, b Box) (*agent.Client, error) {
	if b.State == "paused" {
		return nil, fmt.Errorf("box %q is paused, not running (kvbox start %s resumes it): %w", b.Name, b.Name, ErrBusy)
	}
	if b.State != "running" {
		return nil, fmt.Errorf("box %q is %s, not running (kvbox start %s): %w", b.Name, b.State, b.Name, ErrBusy)
	}
	if b.Transport == "vsock" && b.VsockCID > 2 {
		return agent.DialVsock(ctx, b.VsockCID)
	}
	var paths []string
	for _, p := range AgentSockets(b.Dir) {
		paths = append(paths, p.Path)
	}
	c, err := agent.DialSerial(ctx, paths)
	if errors.Is(err, agent.ErrBusy) {
		return nil, fmt.Errorf("box %q: %v (other kvbox commands use them all; try again when one ends): %w", b.Name, err, ErrBusy)
	}
	return c, err
}

// WaitAgent dials the box's agent until it answers a ping or ctx ends. It
// gives up early when the domain stops running.
func (h *Host) WaitAgent(ctx context.Context, d *libvirt.Domain, b Box) (*agent.Client, error) {
	closeBoxDir(b.Dir) // QEMU has made its sockets and RAM file by now
	var last error
	for {
		if st, _, err := d.GetState(); err == nil && st != libvirt.DOMAIN_RUNNING && st != libvirt.DOMAIN_PAUSED {
			return nil, fmt.Errorf("box %q stopped while booting (%s); its console log is kept in %s", b.Name, stateName(st), h.FailedConsoleLog(b.Name))
		}
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := h.Dial(actx, Box{Name: b.Name, State: "running", Meta: b.Meta, VsockCID: b.VsockCID})
		if err == nil {
			_, err = c.Ping(actx)
			if err == nil {
				cancel()
				return c, nil
			}
			c.Close()
		}
		cancel()
		last = err
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("the agent of box %q did not answer in time (last error: %s); is kvbox-agent in the image? its console log is kept in %s",
				b.Name, strings.ReplaceAll(fmt.Sprint(last), "\n", "; "), h.FailedConsoleLog(b.Name))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Identity is what the host tells a box's agent about who the box is.
func (h *Host) Identity(b Box) agent.Identity {
	id := agent.Identity{
		Hostname:  b.Name,
		MAC:       b.MAC,
		Address:   fmt.Sprintf("%s/%d", b.IP, b.Prefix),
		Gateway:   b.Gateway,
		DNS:       hostNameservers(),
		MachineID: strings.ReplaceAll(b.UUID, "-", ""),
	}
	return id
}

// Reidentify gives the guest its identity, sets its clock to the host's
// and feeds its RNG fresh entropy.
func (h *Host) Reidentify(ctx context.Context, c *agent.Client, b Box) error {
	if err := c.Identify(ctx, h.Identity(b)); err != nil {
		return fmt.Errorf("set the identity of box %q: %w", b.Name, err)
	}
	if err := c.SetClock(ctx, time.Now()); err != nil && !errors.Is(err, errors.ErrUnsupported) {
		return fmt.Errorf("set the clock of box %q: %w", b.Name, err)
	}
	seed := make([]byte, 64)
	if _, err := rand.Read(seed); err != nil {
		return err
	}
	if err := c.AddEntropy(ctx, seed); err != nil && !errors.Is(err, errors.ErrUnsupported) {
		return fmt.Errorf("seed the RNG of box %q: %w", b.Name, err)
	}
	return nil
}

// hostNameservers are the host's resolvers a box can reach through NAT.
// Loopback resolvers (systemd-resolved's stub, a local dnsmasq) are useless
// inside a box; behind systemd-resolved the upstream servers are in its own
// resolv.conf.
func hostNameservers() []string {
	for _, f := range []string{"/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"} {
		if ns := nameservers(f); len(ns) > 0 {
			return ns
		}
	}
	return nil
}

func nameservers(file string) []string {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil
	}
	var ns []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "nameserver" {
			if a, err := netip.ParseAddr(f[1]); err == nil && !a.IsLoopback() {
				ns = append(ns, a.String())
			}
		}
	}
	return ns
}

// readNoFollow reads the regular file at path, refusing a symbolic link or
// anything else that is not a plain file (a FIFO would block).
func readNoFollow(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	return io.ReadAll(f)
}

// Resume continues a paused box (one a failed or interrupted snapshot left
// paused): the guest carries on where it stopped.
func (h *Host) Resume(name string) (Box, error) {
	b, dom, release, err := h.LockedLookup(name)
	if err != nil {
		return Box{}, err
	}
	defer release()
	if b.State != "paused" {
		return Box{}, fmt.Errorf("box %q is %s, not paused: %w", name, b.State, ErrBusy)
	}
	if err := dom.Resume(); err != nil {
		return Box{}, fmt.Errorf("resume box %q: %s", name, LibvirtMessage(err))
	}
	b.State = "running"
	return b, nil
}
