package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// FindSerialPorts lists the agent's virtio-serial ports without udev: it
// reads sysClass/*/name (normally /sys/class/virtio-ports) and returns
// devDir/<vportXpY> for every name that starts with SerialPortPrefix,
// ordered by name.
func FindSerialPorts(sysClass, devDir string) ([]string, error) {
	ents, err := os.ReadDir(sysClass)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	type port struct{ name, dev string }
	var ports []port
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(sysClass, e.Name(), "name"))
		if err != nil {
			continue
		}
		name := strings.TrimSpace(string(b))
		if strings.HasPrefix(name, SerialPortPrefix) {
			ports = append(ports, port{name, filepath.Join(devDir, e.Name())})
		}
	}
	sort.Slice(ports, func(i, j int) bool { return ports[i].name < ports[j].name })
	devs := make([]string, len(ports))
	for i, p := range ports {
		devs[i] = p.dev
	}
	return devs, nil
}

// ServePort serves a virtio-serial port until ctx ends. The port outlives
// host connections, so this goes on across them.
//
// What the guest kernel's virtio_console does (Linux 6.1) with no host
// connected: read returns 0 (EOF) at once whenever no data is buffered, and
// poll reports POLLHUP, so a plain read loop or a level-triggered poll
// spins. write blocks (EAGAIN when non-blocking) until a host connects.
// The kernel wakes the port's wait queue when the host connects and when
// data arrives. The file is registered with Go's edge-triggered netpoller,
// so after an EOF the reader parks until the next wake-up instead of
// polling. A spin guard sleeps if a kernel ever reports EOF wake-ups back
// to back.
func (s *Server) ServePort(ctx context.Context, path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { f.Close() })
	defer stop()
	defer f.Close()
	pr, err := newPortReader(f)
	if err != nil {
		return err
	}
	s.logf("serving %s", path)
	err = s.serve(pr, f, filepath.Base(path), true, true)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// portReader turns a virtio-serial port into an endless stream: a host
// disconnect shows as errHostGone once, then Read waits for the next host.
type portReader struct {
	f       *os.File
	pollOK  bool
	gone    bool      // the last read saw no host
	wakeups int       // EOF wake-ups since spinFrom
	since   time.Time // start of the current burst of EOF wake-ups
}

func newPortReader(f *os.File) (*portReader, error) {
	p := &portReader{f: f, pollOK: true}
	// A file the runtime could not register with epoll makes RawConn.Read
	// fail instead of waiting; find out now.
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		p.pollOK = false
	}
	return p, nil
}

func (p *portReader) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	if !p.pollOK {
		return p.readBlocking(b)
	}
	rc, err := p.f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var rerr error
	hostGone := false
	err = rc.Read(func(fd uintptr) bool {
		m, e := unix.Read(int(fd), b)
		switch {
		case e == unix.EAGAIN || e == unix.EINTR:
			return false // a host is there, no data yet: park
		case e != nil:
			rerr = e
			return true
		case m == 0 && !p.gone:
			// Look again for a while: see hostSettle.
			for end := time.Now().Add(hostSettle); m == 0 && e == nil && time.Now().Before(end); {
				time.Sleep(10 * time.Millisecond)
				m, e = unix.Read(int(fd), b)
			}
			switch {
			case e == unix.EAGAIN || e == unix.EINTR:
				return false // connected after all
			case e != nil:
				rerr = e
				return true
			case m == 0:
				p.gone = true
				hostGone = true
				p.wakeups, p.since = 0, time.Now()
				return true
			}
		case m == 0:
			p.spinGuard()
			return false // park until the kernel wakes the port
		}
		p.gone = false
		n = m
		return true
	})
	if hostGone {
		return 0, errHostGone
	}
	if err != nil {
		return 0, err
	}
	return n, rerr
}

// hostSettle is how long a port that reads as having no host is given
// before the host is taken as gone. The kernel learns that a host
// connected from a control message that a kworker handles, and the host's
// first bytes may come in before that: on 4 GiB Debian clones whose
// kworkers were busy (their balloon giving back the memory it named for
// the snapshot), a first contact was read whole and the read after it
// said no host; the session ended there and its answers were dropped
// (docs/design.md#the-agent-under-tcg). A host that went away is seen this much
// later (an exec it left running is killed then).
const hostSettle = time.Second

// spinGuard sleeps when EOF wake-ups come faster than a host can connect
// and disconnect.
func (p *portReader) spinGuard() {
	p.wakeups++
	if time.Since(p.since) > time.Second {
		p.wakeups, p.since = 0, time.Now()
	}
	if p.wakeups > 20 {
		time.Sleep(100 * time.Millisecond)
	}
}

// readBlocking is the fallback when the port is not pollable: EOF means no
// host, so sleep before reading again.
func (p *portReader) readBlocking(b []byte) (int, error) {
	for {
		n, err := p.f.Read(b)
		if n > 0 {
			p.gone = false
			return n, nil
		}
		if err != nil && !errors.Is(err, io.EOF) {
			return 0, err
		}
		if p.gone {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		// Look again a moment later: see hostSettle.
		time.Sleep(hostSettle)
		if n, err = p.f.Read(b); n > 0 {
			return n, nil
		}
		if err != nil && !errors.Is(err, io.EOF) {
			return 0, err
		}
		p.gone = true
		return 0, errHostGone
	}
}

// ServeSerialPorts serves every agent port under sysClass/devDir, and
// serves ports that appear later (virtio_console loaded late by udev in a
// distro guest) when the kernel announces them, until ctx ends. It returns
// once every port is closed and its exec killed.
//
// It looks again at each kobject uevent of a virtio port (one comes when a
// port appears, and one when it gets its name), not on a clock: a box then
// does nothing while idle, and a clone, whose every code path runs cold
// under emulation, is not held up by a look at sysfs while it is being
// re-identified. Without a uevent socket it looks every second.
func (s *Server) ServeSerialPorts(ctx context.Context, sysClass, devDir string) {
	var wg sync.WaitGroup
	defer wg.Wait()
	serving := map[string]bool{}
	done := make(chan string)
	events, err := portEvents(ctx)
	var every <-chan time.Time // without uevents
	if err != nil {
		s.logf("no uevents (%v): looking for new serial ports every second", err)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		every = tick.C
	}
	for {
		ports, err := FindSerialPorts(sysClass, devDir)
		if err != nil {
			s.logf("find serial ports: %v", err)
		}
		for _, p := range ports {
			if serving[p] {
				continue
			}
			serving[p] = true
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := s.ServePort(ctx, p)
				if err != nil && ctx.Err() == nil {
					s.logf("%s: %v", p, err)
				}
				select {
				case done <- p:
				case <-ctx.Done():
				}
			}()
		}
		select {
		case <-ctx.Done():
			return
		case p := <-done:
			// Retry a failed port a second later.
			delete(serving, p)
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
		case <-events:
		case <-every:
		}
	}
}

// portEvents sends when the kernel announces a change to a virtio port
// (a kobject uevent of subsystem virtio-ports), or when announcements may
// have been lost, until ctx ends.
func portEvents(ctx context.Context) (<-chan struct{}, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_KOBJECT_UEVENT)
	if err != nil {
		return nil, err
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: 1}); err != nil {
		unix.Close(fd)
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "uevents") // non-blocking: read through the netpoller
	context.AfterFunc(ctx, func() { f.Close() })
	ch := make(chan struct{}, 1)
	kick := func() {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	go func() {
		b := make([]byte, 16<<10)
		for {
			n, err := f.Read(b)
			switch {
			case ctx.Err() != nil:
				return
			case errors.Is(err, unix.ENOBUFS):
				kick() // the socket overflowed: events were lost
			case err != nil:
				kick()
				time.Sleep(time.Second)
			case bytes.Contains(b[:n], []byte("\x00SUBSYSTEM=virtio-ports\x00")):
				kick()
			}
		}
	}()
	return ch, nil
}
