package kvbox

import (
	"context"
	"io"
	"path/filepath"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
)

// Stats is one reading of what a running box uses.
type Stats struct {
	At time.Time
	// CPUTime is cumulative: all its vCPUs and its QEMU's own threads.
	CPUTime time.Duration
	// Private is memory only this box holds (what it costs the host);
	// Shared is file pages it maps (a clone's snapshot), which the
	// snapshot's other clones share.
	Private, Shared int64
}

// Stats reads what box name uses now.
func (h *Host) Stats(ctx context.Context, name string) (Stats, error) {
	if _, err := h.d.Get(name); err != nil {
		return Stats{}, err
	}
	cpu, err := h.d.CPUTime(name)
	if err != nil {
		return Stats{}, err
	}
	st := Stats{At: time.Now(), CPUTime: cpu}
	rss, anon, err := domain.QEMUMemory(name)
	if err != nil {
		return st, err
	}
	st.Private, st.Shared = anon, max(0, rss-anon)
	return st, nil
}

// ConsoleLog is what box name's serial console printed (its kernel's and
// init's lines), readable while it runs. QEMU writes the box's folder: the
// file is opened without following a link planted there.
func (h *Host) ConsoleLog(name string) (io.ReadCloser, error) {
	b, err := h.d.Get(name)
	if err != nil {
		return nil, err
	}
	f, err := domain.OpenNoFollow(filepath.Join(b.Dir, "console.log"), 0)
	if err != nil {
		return nil, base.Errorf(base.Unavailable, "box %q's console log: %v", name, err)
	}
	return f, nil
}

// Ping reaches box name's agent, through the connection its streams share
// (Dial), bounded by Config.DialTimeout: the box is up and can be reached.
func (h *Host) Ping(ctx context.Context, name string) error {
	_, err := h.forwarder(ctx, name)
	return err
}

// Capacity is this host's CPUs and memory (bytes), as libvirt sees them.
func (h *Host) Capacity(ctx context.Context) (cpus int, memory int64, err error) {
	info, err := h.d.Conn().GetNodeInfo()
	if err != nil {
		return 0, 0, base.Errorf(base.Unavailable, "read this host's CPUs and memory from libvirt: %s", domain.LibvirtMessage(err))
	}
	return int(info.Cpus), int64(info.Memory) << 10, nil
}

// Healthy says why this host cannot run boxes now (libvirt does not
// answer), or nil.
func (h *Host) Healthy(ctx context.Context) error {
	if _, err := h.d.Conn().GetVersion(); err != nil {
		return base.Errorf(base.Unavailable, "libvirt: %s", domain.LibvirtMessage(err))
	}
	return nil
}
