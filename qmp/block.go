package qmp

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// DirtyBitmap is one entry of a node's "dirty-bitmaps".
type DirtyBitmap struct {
	Name         string `json:"name"`
	Count        int64  `json:"count"`
	Granularity  int64  `json:"granularity"`
	Recording    bool   `json:"recording"`
	Busy         bool   `json:"busy"`
	Persistent   bool   `json:"persistent"`
	Inconsistent bool   `json:"inconsistent,omitempty"`
}

// BlockNode is QEMU's BlockDeviceInfo, as returned by query-named-block-nodes
// and in query-block's "inserted".
type BlockNode struct {
	NodeName         string `json:"node-name"`
	Drv              string `json:"drv"`
	File             string `json:"file"`
	BackingFile      string `json:"backing_file,omitempty"`
	BackingFileDepth int    `json:"backing_file_depth"`
	ReadOnly         bool   `json:"ro"`
	// Active is reported since QEMU 10.0; false after an outgoing migration
	// completed, until blockdev-set-active.
	Active       *bool         `json:"active,omitempty"`
	DirtyBitmaps []DirtyBitmap `json:"dirty-bitmaps,omitempty"`
}

// QueryNamedBlockNodes lists every named block node (flat: children of a
// format node appear as their own entries). libvirt names its nodes
// "libvirt-N-format"/"libvirt-N-storage": find them here, never guess.
func (c *Client) QueryNamedBlockNodes(ctx context.Context) ([]BlockNode, error) {
	var nodes []BlockNode
	err := c.Execute(ctx, "query-named-block-nodes", map[string]any{"flat": true}, &nodes)
	return nodes, err
}

// BlockInfo is one guest-visible block device from query-block. With
// -blockdev (libvirt, or a plain -device drive=NODE) Device is empty and QDev
// names the device; Inserted.NodeName is the top node to back up.
type BlockInfo struct {
	Device   string     `json:"device"`
	QDev     string     `json:"qdev,omitempty"`
	Type     string     `json:"type"`
	Inserted *BlockNode `json:"inserted,omitempty"`
}

// QueryBlock lists the guest's block devices.
func (c *Client) QueryBlock(ctx context.Context) ([]BlockInfo, error) {
	var blocks []BlockInfo
	err := c.Execute(ctx, "query-block", nil, &blocks)
	return blocks, err
}

// ErrNotFound is wrapped when a device, node or job asked for is absent.
var ErrNotFound = errors.New("not found")

// TopNode returns the node-name of the medium inserted in the device whose
// Device or QDev equals name (a qdev path such as
// "/machine/peripheral/virtio-disk0/virtio-backend" or the device id "virtio-disk0").
func (c *Client) TopNode(ctx context.Context, name string) (string, error) {
	blocks, err := c.QueryBlock(ctx)
	if err != nil {
		return "", err
	}
	for _, b := range blocks {
		if b.Inserted == nil {
			continue
		}
		if b.Device == name || b.QDev == name || b.QDev == "/machine/peripheral/"+name+"/virtio-backend" {
			return b.Inserted.NodeName, nil
		}
	}
	return "", fmt.Errorf("qmp: block device %q: %w", name, ErrNotFound)
}

// BlockdevAdd adds a block node; opts is the flat blockdev-add object, for
// a qcow2 file target:
//
//	{"driver": "qcow2", "node-name": "snap1", "backing": null,
//	 "file": {"driver": "file", "filename": "/path/disk.qcow2"}}
//
// "backing": null keeps QEMU from opening the image's backing chain, which a
// backup target with sync=top/incremental does not need.
func (c *Client) BlockdevAdd(ctx context.Context, opts map[string]any) error {
	return c.Execute(ctx, "blockdev-add", opts, nil)
}

// BlockdevDel removes a node added with BlockdevAdd. Its format node must be
// deleted before the protocol node it was given inline is gone.
func (c *Client) BlockdevDel(ctx context.Context, nodeName string) error {
	return c.Execute(ctx, "blockdev-del", map[string]any{"node-name": nodeName}, nil)
}

// BlockdevReopen reopens nodes with new options, in one transaction. Each
// entry is a node's whole set of options, not a change: an option left out
// goes back to its default.
func (c *Client) BlockdevReopen(ctx context.Context, opts []map[string]any) error {
	return c.Execute(ctx, "blockdev-reopen", map[string]any{"options": opts}, nil)
}

// BlockdevSetActive (QEMU >= 10.0) activates or inactivates one node, or all
// nodes when nodeName is "". After `migrate` completes QEMU 10 leaves every
// node inactive; a block job on an inactive node fails, so the snapshot code
// calls BlockdevSetActive(ctx, "", true) before starting the backup.
func (c *Client) BlockdevSetActive(ctx context.Context, nodeName string, active bool) error {
	args := map[string]any{"active": active}
	if nodeName != "" {
		args["node-name"] = nodeName
	}
	return c.Execute(ctx, "blockdev-set-active", args, nil)
}

// Sync modes of blockdev-backup.
const (
	SyncTop         = "top"
	SyncFull        = "full"
	SyncNone        = "none"
	SyncIncremental = "incremental"
	SyncBitmap      = "bitmap"
)

// Bitmap modes of blockdev-backup: what happens to the bitmap at the end.
const (
	BitmapOnSuccess = "on-success"
	BitmapNever     = "never"
	BitmapAlways    = "always"
)

// BitmapAddArgs are block-dirty-bitmap-add's arguments. Persistent bitmaps
// are stored in the qcow2 file when the node closes and survive restarts.
type BitmapAddArgs struct {
	Node        string `json:"node"`
	Name        string `json:"name"`
	Granularity uint32 `json:"granularity,omitempty"`
	Persistent  bool   `json:"persistent,omitempty"`
	Disabled    bool   `json:"disabled,omitempty"`
}

type bitmapRef struct {
	Node string `json:"node"`
	Name string `json:"name"`
}

// BackupArgs are blockdev-backup's arguments. AutoFinalize and AutoDismiss
// default to true in QEMU when nil; set AutoDismiss to false (Bool(false))
// when WaitJob must see the job's final error.
type BackupArgs struct {
	JobID        string `json:"job-id,omitempty"`
	Device       string `json:"device"` // source node-name
	Target       string `json:"target"` // target node-name
	Sync         string `json:"sync"`
	Bitmap       string `json:"bitmap,omitempty"`
	BitmapMode   string `json:"bitmap-mode,omitempty"`
	AutoFinalize *bool  `json:"auto-finalize,omitempty"`
	AutoDismiss  *bool  `json:"auto-dismiss,omitempty"`
	Speed        int64  `json:"speed,omitempty"`
}

// Bool returns a pointer to b, for the optional fields of BackupArgs.
func Bool(b bool) *bool { return &b }

// Action is one action of a QMP transaction.
type Action struct {
	Type string `json:"type"`
	Data any    `json:"data"`
}

// BitmapAddAction is a block-dirty-bitmap-add transaction action.
func BitmapAddAction(a BitmapAddArgs) Action {
	return Action{Type: "block-dirty-bitmap-add", Data: a}
}

// BitmapRemoveAction is a block-dirty-bitmap-remove transaction action.
func BitmapRemoveAction(node, name string) Action {
	return Action{Type: "block-dirty-bitmap-remove", Data: bitmapRef{node, name}}
}

// BitmapClearAction is a block-dirty-bitmap-clear transaction action.
func BitmapClearAction(node, name string) Action {
	return Action{Type: "block-dirty-bitmap-clear", Data: bitmapRef{node, name}}
}

// BackupAction is a blockdev-backup transaction action.
func BackupAction(a BackupArgs) Action {
	return Action{Type: "blockdev-backup", Data: a}
}

// Transaction runs the actions atomically: either all of them take effect or
// none. A bitmap added in the same transaction as a backup starts recording
// at the exact point in time the backup copies.
func (c *Client) Transaction(ctx context.Context, actions ...Action) error {
	if len(actions) == 0 {
		return nil
	}
	return c.Execute(ctx, "transaction", map[string]any{"actions": actions}, nil)
}

// BlockDirtyBitmapAdd adds a dirty bitmap to a node.
func (c *Client) BlockDirtyBitmapAdd(ctx context.Context, a BitmapAddArgs) error {
	return c.Execute(ctx, "block-dirty-bitmap-add", a, nil)
}

// BlockDirtyBitmapRemove removes a dirty bitmap (and its persistent copy).
func (c *Client) BlockDirtyBitmapRemove(ctx context.Context, node, name string) error {
	return c.Execute(ctx, "block-dirty-bitmap-remove", bitmapRef{node, name}, nil)
}

// BlockdevBackup starts a backup job outside a transaction.
func (c *Client) BlockdevBackup(ctx context.Context, a BackupArgs) error {
	return c.Execute(ctx, "blockdev-backup", a, nil)
}

// BlockJob is an entry of query-block-jobs.
type BlockJob struct {
	Type         string `json:"type"`
	Device       string `json:"device"` // the job id
	Len          int64  `json:"len"`
	Offset       int64  `json:"offset"`
	Busy         bool   `json:"busy"`
	Paused       bool   `json:"paused"`
	Speed        int64  `json:"speed"`
	Ready        bool   `json:"ready"`
	Status       string `json:"status"`
	AutoFinalize bool   `json:"auto-finalize"`
	AutoDismiss  bool   `json:"auto-dismiss"`
	Error        string `json:"error,omitempty"`
}

// QueryBlockJobs lists the running block jobs.
func (c *Client) QueryBlockJobs(ctx context.Context) ([]BlockJob, error) {
	var jobs []BlockJob
	err := c.Execute(ctx, "query-block-jobs", nil, &jobs)
	return jobs, err
}

// Job states (qapi/job.json JobStatus).
const (
	JobCreated   = "created"
	JobRunning   = "running"
	JobPaused    = "paused"
	JobReady     = "ready"
	JobStandby   = "standby"
	JobWaiting   = "waiting"
	JobPending   = "pending"
	JobAborting  = "aborting"
	JobConcluded = "concluded"
	JobNull      = "null"
)

// Job is an entry of query-jobs.
type Job struct {
	ID              string `json:"id"`
	Type            string `json:"type"`
	Status          string `json:"status"`
	CurrentProgress int64  `json:"current-progress"`
	TotalProgress   int64  `json:"total-progress"`
	Error           string `json:"error,omitempty"`
}

// FindJob returns the job of jobs with the given id, or nil.
func FindJob(jobs []Job, id string) *Job {
	for i := range jobs {
		if jobs[i].ID == id {
			return &jobs[i]
		}
	}
	return nil
}

// QueryJobs lists every job QEMU still knows, including concluded ones that
// wait to be dismissed.
func (c *Client) QueryJobs(ctx context.Context) ([]Job, error) {
	var jobs []Job
	err := c.Execute(ctx, "query-jobs", nil, &jobs)
	return jobs, err
}

// JobDismiss removes a concluded job.
func (c *Client) JobDismiss(ctx context.Context, id string) error {
	return c.Execute(ctx, "job-dismiss", map[string]any{"id": id}, nil)
}

// JobFinalize finalizes a pending job (one started with auto-finalize off).
func (c *Client) JobFinalize(ctx context.Context, id string) error {
	return c.Execute(ctx, "job-finalize", map[string]any{"id": id}, nil)
}

// JobCancel cancels a job.
func (c *Client) JobCancel(ctx context.Context, id string) error {
	return c.Execute(ctx, "job-cancel", map[string]any{"id": id}, nil)
}

// BlockJobSetSpeed sets a block job's rate limit in bytes per second (0:
// none). A job that sleeps on its limit runs at once on the new one.
func (c *Client) BlockJobSetSpeed(ctx context.Context, id string, speed int64) error {
	return c.Execute(ctx, "block-job-set-speed", map[string]any{"device": id, "speed": speed}, nil)
}

// ErrJobFailed is wrapped by WaitJob's error when the job concluded with an
// error; ErrJobVanished when the job disappeared before WaitJob saw it
// conclude (it was auto-dismissed, so its result is unknown).
var (
	ErrJobFailed   = errors.New("job failed")
	ErrJobVanished = errors.New("job disappeared before it was seen concluded (auto-dismiss on?)")
)

// WaitJob polls query-jobs until the job id is concluded, dismisses it, and
// returns the job's error wrapped with ErrJobFailed if it had one. A job that
// reaches "pending" (auto-finalize off) is finalized, since nothing else would
// move it on. A job absent from the first poll returns ErrNotFound. It
// returns the job as last seen: a concluded backup's current-progress is
// the bytes it copied.
func (c *Client) WaitJob(ctx context.Context, id string, poll time.Duration) (Job, error) {
	if poll <= 0 {
		poll = 10 * time.Millisecond
	}
	seen, finalized := false, false
	last := ""
	for {
		jobs, err := c.QueryJobs(ctx)
		if err != nil {
			if ctx.Err() != nil && last != "" {
				return Job{}, fmt.Errorf("qmp: waiting for job %q (last status %q): %w", id, last, err)
			}
			return Job{}, err
		}
		job := FindJob(jobs, id)
		switch {
		case job == nil && !seen:
			return Job{}, fmt.Errorf("qmp: job %q: %w", id, ErrNotFound)
		case job == nil:
			return Job{}, fmt.Errorf("qmp: job %q: %w", id, ErrJobVanished)
		case job.Status == JobConcluded:
			if err := c.JobDismiss(ctx, id); err != nil {
				return *job, err
			}
			if job.Error != "" {
				return *job, fmt.Errorf("qmp: job %q: %s: %w", id, job.Error, ErrJobFailed)
			}
			return *job, nil
		case job.Status == JobPending && !finalized:
			if err := c.JobFinalize(ctx, id); err != nil {
				return *job, err
			}
			finalized = true
		}
		seen, last = true, job.Status
		select {
		case <-ctx.Done():
			return *job, fmt.Errorf("qmp: waiting for job %q (last status %q): %w", id, job.Status, ctx.Err())
		case <-time.After(poll):
		}
	}
}
