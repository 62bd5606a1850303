// Package libadapter is kvbox-node's Library over kvbox's packages as they
// are today (domain, snapshot, registry), until the kvbox library of issue
// 34 lands: then kvbox-node calls it and this file goes. It holds no policy
// of the CLI's that the library will not have: each method is the library
// call the contract names (LIBRARY-CONTRACT.md), and what the contract
// lacks is in the fleet's list of needs (node-needs.md: the guest's
// hostname apart from the box name, labels written with the definition).
package libadapter

import (
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/registry"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/statedir"
	"kvbox.dev/kvbox/suspend"
	"kvbox.dev/kvbox/templates"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
)

// Config is the host: libvirt, the state dir, the domain type.
type Config struct {
	URI, StateDir string
	DomainType    string // kvm, qemu, or "" for kvm where the host offers it
	// AgentTimeout bounds a clone's or a start's wait for its agent.
	AgentTimeout time.Duration
}

// labelsNS is the XML namespace of a box's labels in its domain's
// <metadata>, beside kvbox's own.
const labelsNS = "https://kvbox.dev/xmlns/labels/1"

// Opener returns kvboxnode's OpenFunc for c.
func Opener(c Config) kvboxnode.OpenFunc {
	return func(ctx context.Context, n network.Config) (kvboxnode.Library, error) { return open(ctx, c, n) }
}

type host struct {
	h       *domain.Host
	snaps   snapshot.Store
	images  image.Store
	timeout time.Duration

	mu  sync.Mutex
	fwd map[string]*agent.Forwarder // one stream carrier per box
}

func open(ctx context.Context, c Config, n network.Config) (*host, error) {
	if c.AgentTimeout <= 0 {
		c.AgentTimeout = 2 * time.Minute
	}
	// Nothing kvbox or its children (qemu-img) create gets world bits.
	syscall.Umask(0o027)
	if err := os.MkdirAll(c.StateDir, statedir.RootMode); err != nil {
		return nil, fmt.Errorf("state dir: %w", err)
	}
	conn, err := domain.Connect(c.URI)
	if err != nil {
		return nil, err
	}
	h := &domain.Host{URI: c.URI, StateDir: c.StateDir, Net: n, Template: templates.Box, DomainTypeOverride: c.DomainType}
	h.SetConn(conn)
	// The state dir's folders and the host's facts (which the Host caches)
	// before anything is asked of it: a host libvirt cannot describe fails
	// here, not at the first pod.
	if err := h.SecureStateDir(); err != nil {
		h.Close()
		return nil, fmt.Errorf("state dir %s: %w", c.StateDir, err)
	}
	if _, err := h.DomainType(); err != nil {
		h.Close()
		return nil, err
	}
	x := &host{h: h, snaps: snapshot.Store{Dir: h.Layout().Snapshots()}, images: image.Store{Dir: h.Layout().Images()},
		timeout: c.AgentTimeout, fwd: map[string]*agent.Forwarder{}}
	// What a killed kvbox left half-done, as every kvbox command does first.
	var errs []error
	errs = append(errs, snapshot.Recover(ctx, h, x.snaps))
	_, err = h.RecoverBoxes()
	errs = append(errs, err)
	h.RemoveOrphanFolders()
	errs = append(errs, suspend.RecoverSuspends(ctx, h))
	if err := errors.Join(errs...); err != nil {
		h.Close()
		return nil, fmt.Errorf("finishing what a killed kvbox left half-done in %s: %w", c.StateDir, err)
	}
	return x, nil
}

func (x *host) Close() error {
	x.mu.Lock()
	for n, f := range x.fwd {
		f.Close()
		delete(x.fwd, n)
	}
	x.mu.Unlock()
	return x.h.Close()
}

func (x *host) Facts(ctx context.Context) (kvboxnode.HostFacts, error) {
	typ, err := x.h.DomainType()
	if err != nil {
		return kvboxnode.HostFacts{}, err
	}
	hc, err := snapshot.HostCompatOf(x.h.Conn(), typ)
	if err != nil {
		return kvboxnode.HostFacts{}, fmt.Errorf("read this host's restore class from libvirt: %s", domain.LibvirtMessage(err))
	}
	info, err := x.h.Conn().GetNodeInfo()
	if err != nil {
		return kvboxnode.HostFacts{}, fmt.Errorf("read this host's CPUs and memory from libvirt: %s", domain.LibvirtMessage(err))
	}
	return kvboxnode.HostFacts{Compat: hc, CPUs: int(info.Cpus), Memory: int64(info.Memory) * 1024}, nil
}

func (x *host) Healthy(ctx context.Context) error {
	if _, err := x.h.Conn().GetVersion(); err != nil {
		return errors.New(domain.LibvirtMessage(err))
	}
	return nil
}

// kind maps kvbox's sentinel errors onto kvboxnode's.
func kind(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, base.ErrNotFound):
		return fmt.Errorf("%w: %w", kvboxnode.ErrNotFound, err)
	case errors.Is(err, base.ErrBusy):
		return fmt.Errorf("%w: %w", kvboxnode.ErrBusy, err)
	case errors.Is(err, base.ErrExists):
		return fmt.Errorf("%w: %w", kvboxnode.ErrExists, err)
	}
	return err
}

// compatible checks this host can restore snapshot s.
func (x *host) compatible(s snapshot.Snapshot) error {
	c, err := snapshot.LoadCompat(x.h.Conn(), s.Dir)
	if err != nil {
		return err
	}
	typ, err := x.h.DomainType()
	if err != nil {
		return err
	}
	if err := c.Check(x.h.Conn(), typ); err != nil {
		return fmt.Errorf("%w: snapshot %q: %s", kvboxnode.ErrIncompatible, s.Name, strings.TrimPrefix(err.Error(), "incompatible host: "))
	}
	return nil
}

func (x *host) Clone(ctx context.Context, r kvboxnode.CloneRequest) (kvboxnode.Box, error) {
	s, err := x.snaps.Get(r.Snapshot)
	if err != nil {
		return kvboxnode.Box{}, kind(err)
	}
	if err := x.compatible(s); err != nil {
		return kvboxnode.Box{}, err
	}
	b, _, err := snapshot.CloneWith(ctx, x.h, s, r.Name, snapshot.CloneOptions{AgentTimeout: x.timeout})
	if err != nil {
		return kvboxnode.Box{}, kind(err)
	}
	// The library takes the hostname and the labels with the clone; here
	// they come right after it, and a failure removes the clone.
	if err := x.finish(ctx, b, r); err != nil {
		x.h.Remove(context.WithoutCancel(ctx), r.Name, true)
		return kvboxnode.Box{}, fmt.Errorf("box %s: %w", r.Name, err)
	}
	return x.box(b, r.Labels), nil
}

func (x *host) finish(ctx context.Context, b domain.Box, r kvboxnode.CloneRequest) error {
	if r.Hostname != "" && r.Hostname != b.Name {
		c, err := x.h.Dial(ctx, b)
		if err != nil {
			return err
		}
		err = c.Identify(ctx, agent.Identity{Hostname: r.Hostname})
		c.Close()
		if err != nil {
			return fmt.Errorf("set the guest's hostname: %w", err)
		}
	}
	if len(r.Labels) == 0 {
		return nil
	}
	s, err := marshalLabels(r.Labels)
	if err != nil {
		return err
	}
	d, err := x.h.Conn().LookupDomainByName(b.Name)
	if err != nil {
		return errors.New(domain.LibvirtMessage(err))
	}
	defer d.Free()
	if err := d.SetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, s, "kvbox-labels", labelsNS, libvirt.DOMAIN_AFFECT_LIVE|libvirt.DOMAIN_AFFECT_CONFIG); err != nil {
		return fmt.Errorf("write its labels: %s", domain.LibvirtMessage(err))
	}
	return nil
}

type labelsXML struct {
	XMLName xml.Name   `xml:"labels"`
	Labels  []labelXML `xml:"label"`
}

type labelXML struct {
	Key   string `xml:"key,attr"`
	Value string `xml:"value,attr"`
}

func marshalLabels(m map[string]string) (string, error) {
	var l labelsXML
	for k, v := range m {
		l.Labels = append(l.Labels, labelXML{k, v})
	}
	b, err := xml.Marshal(l)
	return string(b), err
}

// labels reads a box's labels; none when it has no labels element.
func (x *host) labels(name string) (map[string]string, error) {
	d, err := x.h.Conn().LookupDomainByName(name)
	if err != nil {
		return nil, err
	}
	defer d.Free()
	s, err := d.GetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, labelsNS, libvirt.DOMAIN_AFFECT_CURRENT)
	var le libvirt.Error
	if errors.As(err, &le) && le.Code == libvirt.ERR_NO_DOMAIN_METADATA {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var l labelsXML
	if err := xml.Unmarshal([]byte(s), &l); err != nil {
		return nil, fmt.Errorf("box %s's labels: %w", name, err)
	}
	m := map[string]string{}
	for _, kv := range l.Labels {
		m[kv.Key] = kv.Value
	}
	return m, nil
}

func (x *host) box(b domain.Box, labels map[string]string) kvboxnode.Box {
	return kvboxnode.Box{Name: b.Name, State: string(b.State), IP: b.IP, Snapshot: b.Snapshot, Labels: labels, Created: b.Created,
		CPUs: b.CPUs, Memory: b.MemoryBytes, Disk: b.DiskBytes}
}

func (x *host) Boxes(ctx context.Context) ([]kvboxnode.Box, error) {
	all, err := x.h.Boxes() // this state dir's
	if err != nil {
		return nil, err
	}
	var out []kvboxnode.Box
	for _, b := range all {
		l, err := x.labels(b.Name)
		var le libvirt.Error
		if errors.As(err, &le) && le.Code == libvirt.ERR_NO_DOMAIN {
			continue // removed while we looked
		}
		if err != nil {
			return nil, err
		}
		out = append(out, x.box(b, l))
	}
	return out, nil
}

// get is this state dir's box called name (another state dir's is not
// found).
func (x *host) get(name string) (domain.Box, error) {
	b, err := x.h.Get(name)
	return b, kind(err)
}

func (x *host) Remove(ctx context.Context, name string) error {
	if _, err := x.get(name); err != nil {
		return err
	}
	x.dropForwarder(name)
	// kvbox rm --force less what a pod's box never has (published ports,
	// a TTL, an image version under it); the library's Remove does all.
	return kind(x.h.Remove(ctx, name, true))
}

func (x *host) Start(ctx context.Context, name string) (kvboxnode.Box, error) {
	if _, err := x.get(name); err != nil {
		return kvboxnode.Box{}, err
	}
	x.dropForwarder(name)
	b, err := x.h.Start(ctx, name, x.timeout)
	if err != nil {
		return kvboxnode.Box{}, kind(err)
	}
	l, err := x.labels(name)
	if err != nil {
		return kvboxnode.Box{}, err
	}
	if h := l[kvboxnode.LabelHostname]; h != "" {
		if err := x.finish(ctx, b, kvboxnode.CloneRequest{Hostname: h}); err != nil {
			return kvboxnode.Box{}, err
		}
	}
	return x.box(b, l), nil
}

// forwarder is the box's stream carrier, opened at first use and again
// after its agent connection ended.
func (x *host) forwarder(ctx context.Context, name string) (*agent.Forwarder, error) {
	x.mu.Lock()
	f := x.fwd[name]
	x.mu.Unlock()
	if f != nil {
		select {
		case <-f.Done():
		default:
			return f, nil
		}
	}
	b, err := x.get(name)
	if err != nil {
		return nil, err
	}
	c, err := x.h.Dial(ctx, b)
	if err != nil {
		return nil, kind(err)
	}
	f, err = c.Forward(ctx)
	if err != nil {
		c.Close()
		return nil, err
	}
	f.Tokens = func() [][]byte { return domain.AgentTokens(b.Dir) }
	x.mu.Lock()
	defer x.mu.Unlock()
	if old := x.fwd[name]; old != nil && old != f {
		select {
		case <-old.Done():
		default:
			f.Close() // another caller opened one meanwhile
			return old, nil
		}
	}
	x.fwd[name] = f
	return f, nil
}

func (x *host) dropForwarder(name string) {
	x.mu.Lock()
	f := x.fwd[name]
	delete(x.fwd, name)
	x.mu.Unlock()
	if f != nil {
		f.Close()
	}
}

func (x *host) Ping(ctx context.Context, name string) error {
	_, err := x.forwarder(ctx, name)
	return err
}

func (x *host) Dial(ctx context.Context, name, target string) (net.Conn, error) {
	f, err := x.forwarder(ctx, name)
	if err != nil {
		return nil, err
	}
	// A socket pair: the forwarder gets one end (it half-closes it as the
	// guest's stream does), the caller the other.
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ours, err := fileConn(fds[0])
	if err != nil {
		syscall.Close(fds[1])
		return nil, err
	}
	theirs, err := fileConn(fds[1])
	if err != nil {
		ours.Close()
		return nil, err
	}
	if _, err := f.Connect(ctx, target, theirs); err != nil {
		ours.Close()
		theirs.Close()
		return nil, err
	}
	return ours, nil
}

func fileConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "socketpair")
	defer f.Close()
	return net.FileConn(f)
}

func (x *host) Exec(ctx context.Context, name string, r agent.ExecRequest, stdin io.Reader, stdout, stderr io.Writer, resize <-chan agent.WinSize) (int, error) {
	b, err := x.get(name)
	if err != nil {
		return -1, err
	}
	c, err := x.h.Dial(ctx, b)
	if err != nil {
		return -1, kind(err)
	}
	defer c.Close()
	if r.User != "" {
		// An agent that predates users would run the process as root.
		in, err := c.Ping(ctx)
		if err != nil {
			return -1, err
		}
		if err := in.Require("a user", agent.FeatureExecUser); err != nil {
			return -1, err
		}
	} else if len(r.EnvAdd) > 0 {
		// Every agent honours a whole environment.
		base := r.Env
		if len(base) == 0 {
			base = agent.DefaultEnv(r.TTY, "")
		}
		r.Env, r.EnvAdd = agent.MergeEnv(base, r.EnvAdd), nil
	}
	return c.Exec(ctx, r, stdin, stdout, stderr, resize)
}

func (x *host) ConsoleLog(name string) (io.ReadCloser, error) {
	b, err := x.get(name)
	if err != nil {
		return nil, err
	}
	// QEMU writes the box folder: never follow a link it planted.
	f, err := os.OpenFile(filepath.Join(b.Dir, "console.log"), os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("box %s's console log is not a regular file", name)
	}
	return f, nil
}

func (x *host) Stats(ctx context.Context, name string) (kvboxnode.BoxStats, error) {
	if _, err := x.get(name); err != nil {
		return kvboxnode.BoxStats{}, err
	}
	d, err := x.h.Conn().LookupDomainByName(name)
	if err != nil {
		return kvboxnode.BoxStats{}, kind(fmt.Errorf("%s: %w", domain.LibvirtMessage(err), base.ErrNotFound))
	}
	defer d.Free()
	info, err := d.GetInfo()
	if err != nil {
		return kvboxnode.BoxStats{}, errors.New(domain.LibvirtMessage(err))
	}
	st := kvboxnode.BoxStats{At: time.Now(), CPUTime: time.Duration(info.CpuTime)}
	rss, anon, err := qemuMemory(name)
	if err != nil {
		return st, err
	}
	st.Private, st.Shared = anon, max(0, rss-anon)
	return st, nil
}

// qemuMemory reads the resident and anonymous bytes of the box's QEMU
// (smaps_rollup): anonymous pages are the box's own (its writes, QEMU's
// heap), the rest of what is resident is the snapshot's page cache.
func qemuMemory(name string) (rss, anon int64, err error) {
	b, err := os.ReadFile(filepath.Join("/run/libvirt/qemu", name+".pid"))
	if err != nil {
		return 0, 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return 0, 0, fmt.Errorf("box %s: bad QEMU pid file", name)
	}
	cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmd), "guest="+domain.QemuOptEscape(name)+",") {
		return 0, 0, fmt.Errorf("box %s: its QEMU is not running", name)
	}
	sm, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(sm), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || f[2] != "kB" {
			continue
		}
		v, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "Rss:":
			rss = v * 1024
		case "Anonymous:":
			anon = v * 1024
		}
	}
	return rss, anon, nil
}

func (x *host) Snapshots(ctx context.Context) ([]kvboxnode.Snapshot, error) {
	l, err := x.snaps.List()
	if err != nil {
		return nil, err
	}
	out := make([]kvboxnode.Snapshot, 0, len(l))
	for _, s := range l {
		out = append(out, kvboxnode.Snapshot{Name: s.Name, SizeBytes: s.SizeBytes, CPUs: s.CPUs, Memory: s.MemoryBytes, Disk: s.DiskBytes})
	}
	return out, nil
}

func (x *host) RemoveSnapshot(ctx context.Context, name string) error {
	s, err := x.snaps.Get(name)
	if err != nil {
		return kind(err)
	}
	if err := snapshot.Remove(x.h, x.snaps, name); err != nil {
		return kind(err)
	}
	// A snapshot the node pulled has no deadline, so no reaper to stop
	// (the library's RemoveSnapshot stops one). The base image version the snapshot brought goes with its last user.
	snapshot.PruneVersionOf(ctx, x.h, x.snaps, x.images, s.BaseDisk)
	return nil
}

func options(o kvboxnode.PullOptions) registry.Options {
	return registry.Options{Insecure: o.Insecure, Username: o.Username, Password: o.Password}
}

func (x *host) Resolve(ctx context.Context, ref string, o kvboxnode.PullOptions) (string, error) {
	d, _, err := registry.Inspect(ctx, ref, options(o))
	if err != nil {
		return "", err
	}
	return d.String(), nil
}

func (x *host) Pull(ctx context.Context, ref, name string, o kvboxnode.PullOptions) (kvboxnode.Snapshot, error) {
	ro := options(o)
	var err error
	if ro.DomainType, err = x.h.DomainType(); err != nil {
		return kvboxnode.Snapshot{}, err
	}
	if ro.Emulator, err = x.h.Emulator(); err != nil {
		return kvboxnode.Snapshot{}, err
	}
	// The compatibility check Pull makes first, made here to give its
	// refusal a kind.
	_, m, err := registry.Inspect(ctx, ref, ro)
	if err != nil {
		return kvboxnode.Snapshot{}, err
	}
	var c snapshot.Compat
	if err := json.Unmarshal([]byte(m.Annotations[registry.AnnotCompat]), &c); err != nil {
		return kvboxnode.Snapshot{}, fmt.Errorf("%s: bad %s annotation: %w", ref, registry.AnnotCompat, err)
	}
	if err := c.Check(x.h.Conn(), ro.DomainType); err != nil {
		return kvboxnode.Snapshot{}, fmt.Errorf("%w: %s", kvboxnode.ErrIncompatible, strings.TrimPrefix(err.Error(), "incompatible host: "))
	}
	res, err := registry.Pull(ctx, x.h.Conn(), x.h.StateDir, ref, name, ro)
	if err != nil {
		return kvboxnode.Snapshot{}, kind(err)
	}
	s := res.Snapshot
	return kvboxnode.Snapshot{Name: s.Name, SizeBytes: s.SizeBytes, CPUs: s.CPUs, Memory: s.MemoryBytes, Disk: s.DiskBytes}, nil
}
