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
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/fsnotify/fsnotify"

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
	events    chan *filesystem.FilesystemEvent
	done      chan struct{}
	closeOnce sync.Once
}

func newDirWatch(root string, recursive bool) (*dirWatch, error) {
	st, err := os.Stat(root)
	if err != nil {
		return nil, fsError(err)
	}
	if !st.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s is not a directory", root))
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("watch %s: %w", root, err))
	}
	d := &dirWatch{w: w, root: root, recursive: recursive, events: make(chan *filesystem.FilesystemEvent, 64), done: make(chan struct{})}
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
				select {
				case d.events <- &filesystem.FilesystemEvent{Name: name, Type: ot.t}:
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
	d, err := newDirWatch(p, req.Msg.Recursive)
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
	d, err := newDirWatch(p, req.Msg.Recursive)
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
