package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	gqmp "github.com/digitalocean/go-qemu/qmp"
)

// fakeMonitor records every command and answers with reply(cmd), a full QMP
// reply line ({"return": ...} or {"error": ...}).
type fakeMonitor struct {
	mu    sync.Mutex
	sent  []string
	reply func(execute string, args map[string]any) string
}

func (f *fakeMonitor) Connect() error    { return nil }
func (f *fakeMonitor) Disconnect() error { return nil }
func (f *fakeMonitor) Events(context.Context) (<-chan gqmp.Event, error) {
	return nil, gqmp.ErrEventsNotSupported
}

func (f *fakeMonitor) Run(cmd []byte) ([]byte, error) {
	var req struct {
		Execute   string         `json:"execute"`
		Arguments map[string]any `json:"arguments"`
	}
	if err := json.Unmarshal(cmd, &req); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.sent = append(f.sent, string(cmd))
	f.mu.Unlock()
	if f.reply == nil {
		return []byte(`{"return": {}}`), nil
	}
	return []byte(f.reply(req.Execute, req.Arguments)), nil
}

func (f *fakeMonitor) commands() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.sent...)
}

func jsonEqual(t *testing.T, got, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal([]byte(got), &g); err != nil {
		t.Fatalf("got invalid JSON %q: %v", got, err)
	}
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatalf("want invalid JSON %q: %v", want, err)
	}
	if !reflect.DeepEqual(g, w) {
		t.Errorf("request\n got  %s\n want %s", got, want)
	}
}

// shape is a wrapper's call and the QMP command it must send.
type shape struct {
	name string
	call func(c *Client) error
	want string
}

// The run state's and migration's wrappers send QEMU's argument shapes.
func TestRequestShapes(t *testing.T) {
	ctx := context.Background()
	checkShapes(t, []shape{
		{"stop", func(c *Client) error { return c.Stop(ctx) }, `{"execute":"stop"}`},
		{"cont", func(c *Client) error { return c.Cont(ctx) }, `{"execute":"cont"}`},
		{"query-status", func(c *Client) error { _, err := c.QueryStatus(ctx); return err }, `{"execute":"query-status"}`},
		{"set_link", func(c *Client) error { return c.SetLink(ctx, "net0", false) },
			`{"execute":"set_link","arguments":{"name":"net0","up":false}}`},
		{"announce-self", func(c *Client) error {
			return c.AnnounceSelf(ctx, AnnounceArgs{Initial: 50, Max: 550, Rounds: 5, Step: 100})
		}, `{"execute":"announce-self","arguments":{"initial":50,"max":550,"rounds":5,"step":100}}`},
		{"migrate-set-capabilities", func(c *Client) error {
			return c.MigrateSetCapabilities(ctx, map[string]bool{"x-ignore-shared": true, "mapped-ram": false})
		}, `{"execute":"migrate-set-capabilities","arguments":{"capabilities":[
			{"capability":"mapped-ram","state":false},{"capability":"x-ignore-shared","state":true}]}}`},
		{"query-migrate-capabilities", func(c *Client) error { _, err := c.QueryMigrateCapabilities(ctx); return err },
			`{"execute":"query-migrate-capabilities"}`},
		{"migrate-set-parameters", func(c *Client) error {
			return c.MigrateSetParameters(ctx, map[string]any{"announce-rounds": 0})
		}, `{"execute":"migrate-set-parameters","arguments":{"announce-rounds":0}}`},
		{"query-migrate-parameters", func(c *Client) error { _, err := c.QueryMigrateParameters(ctx); return err },
			`{"execute":"query-migrate-parameters"}`},
		{"migrate", func(c *Client) error { return c.Migrate(ctx, "file:/s/state") },
			`{"execute":"migrate","arguments":{"uri":"file:/s/state"}}`},
		{"migrate-incoming", func(c *Client) error { return c.MigrateIncoming(ctx, "file:/s/state") },
			`{"execute":"migrate-incoming","arguments":{"uri":"file:/s/state"}}`},
		{"migrate_cancel", func(c *Client) error { return c.MigrateCancel(ctx) }, `{"execute":"migrate_cancel"}`},
		{"query-migrate", func(c *Client) error { _, err := c.QueryMigrate(ctx); return err }, `{"execute":"query-migrate"}`},
	})
}

// The block layer's and jobs' wrappers send QEMU's argument shapes.
func TestBlockRequestShapes(t *testing.T) {
	ctx := context.Background()
	checkShapes(t, []shape{
		{"query-named-block-nodes", func(c *Client) error { _, err := c.QueryNamedBlockNodes(ctx); return err },
			`{"execute":"query-named-block-nodes","arguments":{"flat":true}}`},
		{"query-block", func(c *Client) error { _, err := c.QueryBlock(ctx); return err }, `{"execute":"query-block"}`},
		{"blockdev-add", func(c *Client) error {
			return c.BlockdevAdd(ctx, map[string]any{"driver": "qcow2", "node-name": "s1", "backing": nil,
				"file": map[string]any{"driver": "file", "filename": "/s/disk.qcow2"}})
		}, `{"execute":"blockdev-add","arguments":{"driver":"qcow2","node-name":"s1","backing":null,
			"file":{"driver":"file","filename":"/s/disk.qcow2"}}}`},
		{"blockdev-del", func(c *Client) error { return c.BlockdevDel(ctx, "s1") },
			`{"execute":"blockdev-del","arguments":{"node-name":"s1"}}`},
		{"blockdev-reopen", func(c *Client) error {
			return c.BlockdevReopen(ctx, []map[string]any{{"driver": "file", "node-name": "n", "filename": "/d", "drop-cache": false}})
		}, `{"execute":"blockdev-reopen","arguments":{"options":[{"driver":"file","node-name":"n","filename":"/d","drop-cache":false}]}}`},
		{"blockdev-set-active all", func(c *Client) error { return c.BlockdevSetActive(ctx, "", true) },
			`{"execute":"blockdev-set-active","arguments":{"active":true}}`},
		{"blockdev-set-active node", func(c *Client) error { return c.BlockdevSetActive(ctx, "libvirt-1-format", false) },
			`{"execute":"blockdev-set-active","arguments":{"node-name":"libvirt-1-format","active":false}}`},
		{"block-dirty-bitmap-add", func(c *Client) error {
			return c.BlockDirtyBitmapAdd(ctx, BitmapAddArgs{Node: "n", Name: "b", Persistent: true})
		}, `{"execute":"block-dirty-bitmap-add","arguments":{"node":"n","name":"b","persistent":true}}`},
		{"block-dirty-bitmap-remove", func(c *Client) error { return c.BlockDirtyBitmapRemove(ctx, "n", "b") },
			`{"execute":"block-dirty-bitmap-remove","arguments":{"node":"n","name":"b"}}`},
		{"blockdev-backup", func(c *Client) error {
			return c.BlockdevBackup(ctx, BackupArgs{Device: "n", Target: "t", Sync: SyncFull})
		}, `{"execute":"blockdev-backup","arguments":{"device":"n","target":"t","sync":"full"}}`},
		{"transaction first snapshot", func(c *Client) error {
			return c.Transaction(ctx,
				BitmapAddAction(BitmapAddArgs{Node: "libvirt-1-format", Name: "kvbox", Persistent: true}),
				BackupAction(BackupArgs{JobID: "j1", Device: "libvirt-1-format", Target: "s1", Sync: SyncTop,
					AutoFinalize: Bool(true), AutoDismiss: Bool(false)}))
		}, `{"execute":"transaction","arguments":{"actions":[
			{"type":"block-dirty-bitmap-add","data":{"node":"libvirt-1-format","name":"kvbox","persistent":true}},
			{"type":"blockdev-backup","data":{"job-id":"j1","device":"libvirt-1-format","target":"s1","sync":"top",
				"auto-finalize":true,"auto-dismiss":false}}]}}`},
		{"transaction incremental", func(c *Client) error {
			return c.Transaction(ctx,
				BackupAction(BackupArgs{JobID: "j2", Device: "n", Target: "s2", Sync: SyncIncremental,
					Bitmap: "kvbox", BitmapMode: BitmapOnSuccess}),
				BitmapClearAction("n", "other"),
				BitmapRemoveAction("n", "old"))
		}, `{"execute":"transaction","arguments":{"actions":[
			{"type":"blockdev-backup","data":{"job-id":"j2","device":"n","target":"s2","sync":"incremental",
				"bitmap":"kvbox","bitmap-mode":"on-success"}},
			{"type":"block-dirty-bitmap-clear","data":{"node":"n","name":"other"}},
			{"type":"block-dirty-bitmap-remove","data":{"node":"n","name":"old"}}]}}`},
		{"query-block-jobs", func(c *Client) error { _, err := c.QueryBlockJobs(ctx); return err }, `{"execute":"query-block-jobs"}`},
		{"query-jobs", func(c *Client) error { _, err := c.QueryJobs(ctx); return err }, `{"execute":"query-jobs"}`},
		{"job-dismiss", func(c *Client) error { return c.JobDismiss(ctx, "j1") }, `{"execute":"job-dismiss","arguments":{"id":"j1"}}`},
		{"job-finalize", func(c *Client) error { return c.JobFinalize(ctx, "j1") }, `{"execute":"job-finalize","arguments":{"id":"j1"}}`},
		{"job-cancel", func(c *Client) error { return c.JobCancel(ctx, "j1") }, `{"execute":"job-cancel","arguments":{"id":"j1"}}`},
	})
}

// checkShapes calls each wrapper on a fake monitor and compares the one
// command it sent with want.
func checkShapes(t *testing.T, tests []shape) {
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeMonitor{reply: func(execute string, _ map[string]any) string {
				switch execute {
				case "query-migrate-capabilities", "query-named-block-nodes", "query-block",
					"query-block-jobs", "query-jobs":
					return `{"return": []}`
				}
				return `{"return": {}}`
			}}
			if err := tt.call(New(f)); err != nil {
				t.Fatal(err)
			}
			sent := f.commands()
			if len(sent) != 1 {
				t.Fatalf("sent %d commands, want 1: %q", len(sent), sent)
			}
			jsonEqual(t, sent[0], tt.want)
		})
	}
}

func TestErrorClasses(t *testing.T) {
	tests := []struct {
		class    string
		sentinel error
	}{
		{ClassGenericError, ErrGeneric},
		{ClassCommandNotFound, ErrCommandNotFound},
		{ClassDeviceNotFound, ErrDeviceNotFound},
		{ClassDeviceNotActive, ErrDeviceNotActive},
		{ClassKVMMissingCap, nil},
	}
	all := []error{ErrGeneric, ErrCommandNotFound, ErrDeviceNotFound, ErrDeviceNotActive}
	for _, tt := range tests {
		t.Run(tt.class, func(t *testing.T) {
			f := &fakeMonitor{reply: func(string, map[string]any) string {
				return `{"error": {"class": "` + tt.class + `", "desc": "it broke"}, "id": "libvirt-42"}`
			}}
			err := New(f).BlockdevDel(context.Background(), "x")
			var qe *Error
			if !errors.As(err, &qe) {
				t.Fatalf("error %v is not a *qmp.Error", err)
			}
			if qe.Class != tt.class || qe.Desc != "it broke" || qe.Command != "blockdev-del" {
				t.Errorf("got %+v", qe)
			}
			for _, s := range all {
				if got := errors.Is(err, s); got != (s == tt.sentinel) {
					t.Errorf("errors.Is(%v) = %v", s, got)
				}
			}
			if !strings.Contains(err.Error(), "it broke") {
				t.Errorf("message %q lacks QEMU's desc", err)
			}
		})
	}
}

func TestTransportErrorIsNotQMPError(t *testing.T) {
	boom := errors.New("connection reset")
	c := New(runFunc(func([]byte) ([]byte, error) { return nil, boom }))
	err := c.Stop(context.Background())
	var qe *Error
	if !errors.Is(err, boom) || errors.As(err, &qe) {
		t.Fatalf("got %v", err)
	}
}

func TestBadReply(t *testing.T) {
	c := New(runFunc(func([]byte) ([]byte, error) { return []byte(`not json`), nil }))
	if err := c.Stop(context.Background()); err == nil {
		t.Fatal("no error for a reply that is not JSON")
	}
	c = New(runFunc(func([]byte) ([]byte, error) { return []byte(`{}`), nil }))
	if _, err := c.QueryStatus(context.Background()); err == nil {
		t.Fatal("no error for a reply without return")
	}
}

type runFunc func([]byte) ([]byte, error)

func (runFunc) Connect() error                                    { return nil }
func (runFunc) Disconnect() error                                 { return nil }
func (runFunc) Events(context.Context) (<-chan gqmp.Event, error) { return nil, nil }
func (r runFunc) Run(b []byte) ([]byte, error)                    { return r(b) }

func TestTimeout(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	c := New(runFunc(func([]byte) ([]byte, error) {
		<-release
		return []byte(`{"return": {}}`), nil
	}))
	c.Timeout = 20 * time.Millisecond
	start := time.Now()
	err := c.Stop(context.Background())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("timeout took %v", d)
	}

	// The caller's earlier deadline wins over the per-command timeout.
	c.Timeout = time.Hour
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := c.Cont(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want DeadlineExceeded", err)
	}
}

func TestDecodeReplies(t *testing.T) {
	f := &fakeMonitor{reply: func(execute string, _ map[string]any) string {
		switch execute {
		case "query-named-block-nodes":
			return `{"return": [{"node-name": "libvirt-1-format", "drv": "qcow2", "file": "/b/disk.qcow2",
				"backing_file": "/b/base.qcow2", "backing_file_depth": 1, "ro": false, "active": false,
				"dirty-bitmaps": [{"name": "kvbox", "count": 65536, "granularity": 65536, "recording": true,
				"busy": false, "persistent": true}]}]}`
		case "query-block":
			return `{"return": [{"device": "", "qdev": "/machine/peripheral/virtio-disk0/virtio-backend",
				"type": "unknown", "inserted": {"node-name": "libvirt-1-format", "drv": "qcow2"}},
				{"device": "cd", "type": "unknown"}]}`
		case "query-status":
			return `{"return": {"running": false, "status": "postmigrate"}}`
		}
		return `{"return": {}}`
	}}
	c := New(f)
	ctx := context.Background()
	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	n := nodes[0]
	if n.NodeName != "libvirt-1-format" || n.BackingFileDepth != 1 || n.Active == nil || *n.Active ||
		len(n.DirtyBitmaps) != 1 || n.DirtyBitmaps[0].Count != 65536 || !n.DirtyBitmaps[0].Persistent {
		t.Errorf("decoded %+v", n)
	}
	for _, name := range []string{"virtio-disk0", "/machine/peripheral/virtio-disk0/virtio-backend"} {
		if top, err := c.TopNode(ctx, name); err != nil || top != "libvirt-1-format" {
			t.Errorf("TopNode(%q) = %q, %v", name, top, err)
		}
	}
	if _, err := c.TopNode(ctx, "cd"); !errors.Is(err, ErrNotFound) {
		t.Errorf("TopNode of an empty drive: %v", err)
	}
	if s, err := c.QueryStatus(ctx); err != nil || s.Status != "postmigrate" || s.Running {
		t.Errorf("status %+v, %v", s, err)
	}
}
