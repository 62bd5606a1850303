package envd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/guest-agent/envd/spec/filesystem"
)

// maxPolledEvents bounds what a polling watcher keeps between two
// GetWatcherEvents; older events are dropped beyond it.
const maxPolledEvents = 10000

// dirWatch watches a directory (and, recursive, the directories under it,
// those made later too) with inotify, through fsnotify.
type dirWatch struct {
	w         *fsnotify.Watcher
	root      string
	recursive bool
	// entries: each create, write and chmod event carries the entry's
	// EntryInfo (include_entry, envd 0.6.3).
	entries   bool
	events    chan *filesystem.FilesystemEvent
	done      chan struct{}
	closeOnce sync.Once
}

// watchOptions are what a watch request asks besides its path.
type watchOptions struct {
	recursive, entries, networkMounts bool
}

func newDirWatch(root string, o watchOptions) (*dirWatch, error) {
	st, err := os.Stat(root)
	if err != nil {
		return nil, fsError(err)
	}
	if !st.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s is not a directory", root))
	}
	// A network filesystem's changes made elsewhere never reach inotify:
	// such a watch is refused unless asked for (allow_network_mounts,
	// envd 0.6.4), as E2B's envd does.
	if !o.networkMounts {
		network, err := onNetworkMount(root)
		if err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("watch %s: %w", root, err))
		}
		if network {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cannot watch %s: it is on a network filesystem (NFS, SMB, FUSE), whose changes inotify may never see; allowNetworkMounts watches it anyway", root))
		}
	}
	recursive := o.recursive
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("watch %s: %w", root, err))
	}
	d := &dirWatch{w: w, root: root, recursive: recursive, entries: o.entries, events: make(chan *filesystem.FilesystemEvent, 64), done: make(chan struct{})}
	if err := d.add(root); err != nil {
		w.Close()
		return nil, fsError(err)
	}
	go d.loop()
	return d, nil
}

// add watches dir, and with recursive every directory under it.
func (d *dirWatch) add(dir string) error {
	if !d.recursive {
		return d.w.Add(dir)
	}
	return filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			if p == dir {
				return err
			}
			return nil // gone or unreadable below: not watched
		}
		if de.IsDir() {
			if err := d.w.Add(p); err != nil && p == dir {
				return err
			}
		}
		return nil
	})
}

func (d *dirWatch) close() {
	d.closeOnce.Do(func() {
		close(d.done)
		d.w.Close()
	})
}

var opTypes = []struct {
	op fsnotify.Op
	t  filesystem.EventType
}{
	{fsnotify.Create, filesystem.EventType_EVENT_TYPE_CREATE},
	{fsnotify.Write, filesystem.EventType_EVENT_TYPE_WRITE},
	{fsnotify.Remove, filesystem.EventType_EVENT_TYPE_REMOVE},
	{fsnotify.Rename, filesystem.EventType_EVENT_TYPE_RENAME},
	{fsnotify.Chmod, filesystem.EventType_EVENT_TYPE_CHMOD},
}

// carriesEntry says an event of type t names an entry that is still
// there: a remove's or a rename's path names what is gone (or a new entry
// made there since), so those never carry one.
func carriesEntry(t filesystem.EventType) bool {
	switch t {
	case filesystem.EventType_EVENT_TYPE_CREATE, filesystem.EventType_EVENT_TYPE_WRITE, filesystem.EventType_EVENT_TYPE_CHMOD:
		return true
	}
	return false
}

// The magic numbers of the network filesystems (statfs(2)): NFS, CIFS,
// SMB, SMB2 and FUSE, whose changes made elsewhere inotify never sees.
var networkFSMagic = []int64{0x6969, 0xFF534D42, 0x517B, 0xFE534D42, 0x65735546}

// onNetworkMount says whether path is on a network filesystem.
func onNetworkMount(path string) (bool, error) {
	t, err := fsType(path)
	return slices.Contains(networkFSMagic, t), err
}

// fsType is the magic number of the filesystem path is on (a test gives
// one of a network filesystem, which it cannot mount).
var fsType = func(path string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, err
	}
	return int64(st.Type), nil
}

func (d *dirWatch) loop() {
	defer close(d.events)
	for {
		select {
		case <-d.done:
			return
		case err, ok := <-d.w.Errors:
			if !ok {
				return
			}
			_ = err // an overflow: events were lost, the watch goes on
		case ev, ok := <-d.w.Events:
			if !ok {
				return
			}
			if d.recursive && ev.Has(fsnotify.Create) {
				if st, err := os.Lstat(ev.Name); err == nil && st.IsDir() {
					d.add(ev.Name)
				}
			}
			name, err := filepath.Rel(d.root, ev.Name)
			if err != nil {
				name = ev.Name
			}
			for _, ot := range opTypes {
				if !ev.Has(ot.op) {
					continue
				}
				fe := &filesystem.FilesystemEvent{Name: name, Type: ot.t}
				if d.entries && carriesEntry(ot.t) {
					// Best effort: gone by now, it has none.
					fe.Entry, _ = entryInfo(ev.Name)
				}
				select {
				case d.events <- fe:
				case <-d.done:
					return
				}
			}
		}
	}
}

func (fsv *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystem.WatchDirRequest], stream *connect.ServerStream[filesystem.WatchDirResponse]) error {
	p, _, err := fsv.s.callPath(req.Header(), req.Msg.Path)
	if err != nil {
		return err
	}
	d, err := newDirWatch(p, watchOptions{recursive: req.Msg.Recursive, entries: req.Msg.IncludeEntry, networkMounts: req.Msg.AllowNetworkMounts})
	if err != nil {
		return err
	}
	defer d.close()
	if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Start{Start: &filesystem.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	interval := keepaliveInterval(req.Header())
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case ev, ok := <-d.events:
			if !ok {
				return connect.NewError(connect.CodeInternal, fmt.Errorf("the watch of %s ended", p))
			}
			if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Filesystem{Filesystem: ev}}); err != nil {
				return err
			}
			t.Reset(interval)
		case <-t.C:
			if err := stream.Send(&filesystem.WatchDirResponse{Event: &filesystem.WatchDirResponse_Keepalive{Keepalive: &filesystem.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return connect.NewError(connect.CodeDeadlineExceeded, errors.New("the call's timeout (Connect-Timeout-Ms) passed"))
			}
			return ctx.Err()
		}
	}
}

// watchers are the polling watchers (CreateWatcher), by id.
type watchers struct {
	mu   sync.Mutex
	byID map[string]*polledWatch
}

type polledWatch struct {
	d      *dirWatch
	mu     sync.Mutex
	events []*filesystem.FilesystemEvent
}

func (fsv *filesystemService) CreateWatcher(ctx context.Context, req *connect.Request[filesystem.CreateWatcherRequest]) (*connect.Response[filesystem.CreateWatcherResponse], error) {
	p, _, err := fsv.s.callPath(req.Header(), req.Msg.Path)
	if err != nil {
		return nil, err
	}
	d, err := newDirWatch(p, watchOptions{recursive: req.Msg.Recursive, entries: req.Msg.IncludeEntry, networkMounts: req.Msg.AllowNetworkMounts})
	if err != nil {
		return nil, err
	}
	pw := &polledWatch{d: d}
	go func() {
		for ev := range d.events {
			pw.mu.Lock()
			if len(pw.events) >= maxPolledEvents {
				pw.events = pw.events[1:]
			}
			pw.events = append(pw.events, ev)
			pw.mu.Unlock()
		}
	}()
	b := make([]byte, 8)
	rand.Read(b)
	id := hex.EncodeToString(b)
	ws := &fsv.s.watchers
	ws.mu.Lock()
	if ws.byID == nil {
		ws.byID = map[string]*polledWatch{}
	}
	ws.byID[id] = pw
	ws.mu.Unlock()
	return connect.NewResponse(&filesystem.CreateWatcherResponse{WatcherId: id}), nil
}

func (fsv *filesystemService) watcher(id string) (*polledWatch, error) {
	ws := &fsv.s.watchers
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if pw := ws.byID[id]; pw != nil {
		return pw, nil
	}
	return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", id))
}

func (fsv *filesystemService) GetWatcherEvents(ctx context.Context, req *connect.Request[filesystem.GetWatcherEventsRequest]) (*connect.Response[filesystem.GetWatcherEventsResponse], error) {
	pw, err := fsv.watcher(req.Msg.WatcherId)
	if err != nil {
		return nil, err
	}
	pw.mu.Lock()
	evs := pw.events
	pw.events = nil
	pw.mu.Unlock()
	return connect.NewResponse(&filesystem.GetWatcherEventsResponse{Events: evs}), nil
}

func (fsv *filesystemService) RemoveWatcher(ctx context.Context, req *connect.Request[filesystem.RemoveWatcherRequest]) (*connect.Response[filesystem.RemoveWatcherResponse], error) {
	pw, err := fsv.watcher(req.Msg.WatcherId)
	if err != nil {
		return nil, err
	}
	ws := &fsv.s.watchers
	ws.mu.Lock()
	delete(ws.byID, req.Msg.WatcherId)
	ws.mu.Unlock()
	pw.d.close()
	return connect.NewResponse(&filesystem.RemoveWatcherResponse{}), nil
}
