package qmp

// This test drives a real QEMU (no libvirt) through a plain QMP socket to
// prove the wrappers' argument shapes against the installed QEMU. It skips
// only when qemu-system-x86_64 or qemu-img is missing. QEMU facts it relies
// on, checked with QEMU 10.0.2:
//   - migrate/migrate-incoming still take {"uri": "file:PATH"}.
//   - after `migrate` completes the run state is "postmigrate",
//     query-named-block-nodes reports "active": false, and a backup
//     transaction fails with "Could not create node: Inactive 'disk-format'
//     can't be a file child of active '#block360'" (the copy-before-write
//     filter); blockdev-set-active {"active": true} (no node-name = all
//     nodes) fixes it, and `cont` from postmigrate works afterwards.
//   - the backup target is blockdev-add {"driver": "qcow2", "node-name",
//     "backing": null, "file": {"driver": "file", "filename"}}.
//   - block-dirty-bitmap-add {"node", "name", "persistent": true} inside a
//     transaction together with blockdev-backup {"job-id", "device", "target",
//     "sync": "top", "auto-dismiss": false}; the incremental backup is
//     {"sync": "incremental", "bitmap", "bitmap-mode": "on-success"}.
//   - a job started with auto-dismiss false stays in query-jobs with status
//     "concluded" until job-dismiss {"id"}.
//   - HMP `qemu-io` must name the device's BlockBackend by qdev path
//     (-d /machine/peripheral/ID/virtio-backend): on the node name it hits a
//     permission conflict, since virtio-blk does not share write.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	gqmp "github.com/digitalocean/go-qemu/qmp"

	"kvbox.dev/kvbox/testenv/gate"
)

// socketMonitor is a minimal go-qemu qmp.Monitor over a QMP unix socket that,
// unlike go-qemu's SocketMonitor, hands back error replies verbatim so the
// Client can keep their class.
type socketMonitor struct {
	mu   sync.Mutex
	conn net.Conn
	r    *bufio.Reader
}

func dialQMP(t *testing.T, path string) *socketMonitor {
	t.Helper()
	var conn net.Conn
	var err error
	for i := 0; i < 200; i++ {
		conn, err = net.Dial("unix", path)
		if err == nil {
			break
		}
		time.Sleep(25 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("dial QMP socket: %v", err)
	}
	m := &socketMonitor{conn: conn, r: bufio.NewReader(conn)}
	if _, err := m.r.ReadBytes('\n'); err != nil { // greeting
		t.Fatalf("read QMP greeting: %v", err)
	}
	if out, err := m.Run([]byte(`{"execute":"qmp_capabilities"}`)); err != nil || strings.Contains(string(out), `"error"`) {
		t.Fatalf("qmp_capabilities: %s %v", out, err)
	}
	return m
}

func (m *socketMonitor) Connect() error    { return nil }
func (m *socketMonitor) Disconnect() error { return m.conn.Close() }
func (m *socketMonitor) Events(context.Context) (<-chan gqmp.Event, error) {
	return nil, ErrEventsViaLibvirt
}

func (m *socketMonitor) Run(cmd []byte) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.conn.Write(append(cmd, '\n')); err != nil {
		return nil, err
	}
	for {
		line, err := m.r.ReadBytes('\n')
		if err != nil {
			return nil, err
		}
		var probe struct {
			Event string `json:"event"`
		}
		if json.Unmarshal(line, &probe) == nil && probe.Event != "" {
			continue
		}
		return line, nil
	}
}

func requireTools(t *testing.T, tools ...string) {
	t.Helper()
	gate.Tools(t, tools...)
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func hmp(ctx context.Context, t *testing.T, c *Client, line string) {
	t.Helper()
	var out string
	if err := c.Execute(ctx, "human-monitor-command", map[string]any{"command-line": line}, &out); err != nil {
		t.Fatalf("hmp %q: %v", line, err)
	}
	if strings.Contains(out, "rror") || strings.Contains(out, "onflict") || strings.Contains(out, "failed") {
		t.Fatalf("hmp %q: %s", line, out)
	}
}

func accel() string {
	if f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0); err == nil {
		f.Close()
		return "kvm"
	}
	return "tcg"
}

// realQEMU is TestRealQEMU's scene: a QEMU whose disk is an overlay above
// a base image, driven through c, and the files its steps write.
type realQEMU struct {
	dir, base, state, snap1, snap2 string
	c                              *Client
	top                            string          // the disk's top node
	wctx                           context.Context // bounds each wait for a migration or a job
}

func TestRealQEMU(t *testing.T) {
	requireTools(t, "qemu-system-x86_64", "qemu-img", "qemu-io")
	gate.Long(t)
	ctx := context.Background()
	q := startRealQEMU(t)
	c := q.c

	// Error classes come back typed.
	if err := c.Execute(ctx, "no-such-command", nil, nil); !isClass(err, ClassCommandNotFound) {
		t.Fatalf("unknown command: %v", err)
	}
	if err := c.BlockdevDel(ctx, "no-such-node"); !isClass(err, ClassGenericError) {
		t.Fatalf("blockdev-del of a missing node: %v", err)
	}

	var err error
	q.top, err = c.TopNode(ctx, "virtio-disk0")
	if err != nil || q.top != "disk-format" {
		t.Fatalf("TopNode = %q, %v", q.top, err)
	}
	hmp(ctx, t, c, `qemu-io -d /machine/peripheral/virtio-disk0/virtio-backend "write -P 0xcd 0 64k"`)

	q.snapshot1(ctx, t)
	q.snapshot2(ctx, t)
	q.checkImages(t)
	// An incoming migration on a second QEMU loads snapshot 1's state.
	t.Run("incoming", func(t *testing.T) { q.incoming(ctx, t) })
}

// qemuArgs starts a QEMU with 128 MiB of RAM in the file memory (its
// memory-backend-file options memOpts) and the qcow2 disk as virtio-disk0,
// its QMP on sock.
func qemuArgs(memory, memOpts, disk, sock string, extra ...string) []string {
	args := []string{"-nodefaults", "-display", "none", "-serial", "none",
		"-machine", "q35,accel=" + accel() + ",memory-backend=kvbox.ram",
		"-m", "128M",
		"-object", "memory-backend-file,id=kvbox.ram,size=128M,mem-path=" + memory + "," + memOpts,
		"-blockdev", "driver=file,filename=" + disk + ",node-name=disk-storage",
		"-blockdev", "driver=qcow2,file=disk-storage,node-name=disk-format",
		"-device", "virtio-blk-pci,drive=disk-format,id=virtio-disk0"}
	args = append(args, extra...)
	return append(args, "-qmp", "unix:"+sock+",server=on,wait=off")
}

// startRealQEMU makes the base image (4 MiB of 0x11) and the disk above
// it, and starts a QEMU on them with shared RAM, killed when t ends.
func startRealQEMU(t *testing.T) *realQEMU {
	dir := t.TempDir()
	q := &realQEMU{dir: dir, base: filepath.Join(dir, "base.qcow2"), state: filepath.Join(dir, "state"),
		snap1: filepath.Join(dir, "snap1.qcow2"), snap2: filepath.Join(dir, "snap2.qcow2")}
	disk := filepath.Join(dir, "disk.qcow2")
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", q.base, "64M")
	run(t, "qemu-io", "-c", "write -P 0x11 0 4M", q.base)
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", q.base, disk)

	sock := filepath.Join(dir, "qmp.sock")
	qemu := exec.Command("qemu-system-x86_64", qemuArgs(filepath.Join(dir, "memory"), "share=on", disk, sock)...)
	var stderr strings.Builder
	qemu.Stderr = &stderr
	if err := qemu.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		qemu.Process.Kill()
		qemu.Wait()
		if t.Failed() {
			t.Logf("qemu stderr: %s", stderr.String())
		}
	})
	mon := dialQMP(t, sock)
	t.Cleanup(func() { mon.Disconnect() })
	q.c = New(mon)
	q.c.Timeout = 20 * time.Second
	wctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	q.wctx = wctx
	return q
}

// snapshot1: pause, x-ignore-shared, migrate to a file; the disk's nodes
// active again, a full backup to snap1 with a bitmap from that point;
// the migration settings as they were after it.
func (q *realQEMU) snapshot1(ctx context.Context, t *testing.T) {
	c := q.c
	capsBefore, err := c.QueryMigrateCapabilities(ctx)
	if err != nil {
		t.Fatal(err)
	}
	paramsBefore, err := c.QueryMigrateParameters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	restore := q.migrateToFile(ctx, t)
	q.probeInactive(ctx, t)
	if err := c.BlockdevSetActive(ctx, "", true); err != nil {
		t.Fatal(err)
	}
	assertActive(ctx, t, c, "disk-format", true)
	q.backup1(ctx, t, restore)

	capsAfter, err := c.QueryMigrateCapabilities(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(capsAfter) != fmt.Sprint(capsBefore) {
		t.Fatalf("capabilities not restored:\nbefore %v\nafter  %v", capsBefore, capsAfter)
	}
	paramsAfter, err := c.QueryMigrateParameters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(paramsAfter) != fmt.Sprint(paramsBefore) {
		t.Fatalf("parameters not restored:\nbefore %v\nafter  %v", paramsBefore, paramsAfter)
	}

	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if bm := findBitmap(nodes, q.top, "kvbox"); bm == nil || !bm.Persistent || bm.Count == 0 {
		t.Fatalf("bitmap kvbox after the second write: %+v", bm)
	}
}

// migrateToFile sets x-ignore-shared, stops the guest and migrates it to
// the state file, which then holds no RAM; QEMU is then postmigrate with
// its disk's nodes inactive. restore puts the migration settings back.
func (q *realQEMU) migrateToFile(ctx context.Context, t *testing.T) (restore func(context.Context) error) {
	c := q.c
	restore, err := c.ApplyMigrationSettings(ctx,
		map[string]bool{CapIgnoreShared: true},
		map[string]any{ParamAnnounceRounds: 0, ParamAnnounceInitial: 10})
	if err != nil {
		t.Fatal(err)
	}
	if caps, _ := c.QueryMigrateCapabilities(ctx); !caps[CapIgnoreShared] {
		t.Fatal("x-ignore-shared not set")
	}
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Migrate(ctx, "file:"+q.state); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitMigration(q.wctx, 5*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(q.state); err != nil || st.Size() > 16<<20 {
		t.Fatalf("state file: %v (x-ignore-shared should leave RAM out)", err)
	}
	if s, err := c.QueryStatus(ctx); err != nil || s.Status != "postmigrate" {
		t.Fatalf("status after migrate = %+v, %v", s, err)
	}
	assertActive(ctx, t, c, "disk-format", false)
	return restore
}

// probeInactive logs what a backup does while the disk's nodes are
// inactive (the QEMU fact the package comment records), and cleans up.
func (q *realQEMU) probeInactive(ctx context.Context, t *testing.T) {
	c := q.c
	probe := filepath.Join(q.dir, "probe.qcow2")
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", q.base, probe)
	if err := c.BlockdevAdd(ctx, qcow2Target("probe", probe)); err != nil {
		t.Logf("blockdev-add while nodes are inactive: %v", err)
		return
	}
	err := c.Transaction(ctx,
		BitmapAddAction(BitmapAddArgs{Node: q.top, Name: "probe", Persistent: true}),
		BackupAction(BackupArgs{JobID: "probe", Device: q.top, Target: "probe", Sync: SyncTop, AutoDismiss: Bool(false)}))
	t.Logf("backup transaction while nodes are inactive: %v", err)
	if err == nil {
		_, err := c.WaitJob(ctx, "probe", time.Millisecond)
		t.Logf("wait: %v", err)
		c.BlockDirtyBitmapRemove(ctx, q.top, "probe")
	}
	t.Logf("blockdev-del probe: %v", c.BlockdevDel(ctx, "probe"))
}

// backup1 backs the disk up to snap1 as it is at this point, with the
// bitmap kvbox from then on, while the guest runs on (restore: the
// migration settings put back once it does) and writes at 1M.
func (q *realQEMU) backup1(ctx context.Context, t *testing.T, restore func(context.Context) error) {
	c := q.c
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", q.base, q.snap1)
	if err := c.BlockdevAdd(ctx, qcow2Target("snap1", q.snap1)); err != nil {
		t.Fatal(err)
	}
	err := c.Transaction(ctx,
		BitmapAddAction(BitmapAddArgs{Node: q.top, Name: "kvbox", Persistent: true}),
		BackupAction(BackupArgs{JobID: "backup1", Device: q.top, Target: "snap1", Sync: SyncTop, AutoDismiss: Bool(false)}))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Cont(ctx); err != nil {
		t.Fatal(err)
	}
	if err := restore(ctx); err != nil {
		t.Fatal(err)
	}
	// Writes after the point in time must not reach snapshot 1.
	hmp(ctx, t, c, `qemu-io -d /machine/peripheral/virtio-disk0/virtio-backend "write -P 0xef 1M 64k"`)
	if _, err := c.WaitJob(q.wctx, "backup1", 5*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if jobs, err := c.QueryJobs(ctx); err != nil || len(jobs) != 0 {
		t.Fatalf("jobs after WaitJob: %+v, %v", jobs, err)
	}
	if err := c.BlockdevDel(ctx, "snap1"); err != nil {
		t.Fatal(err)
	}
}

// snapshot2: incremental, into an image backed by snapshot 1: it copies
// the one write since, and clears the bitmap on success.
func (q *realQEMU) snapshot2(ctx context.Context, t *testing.T) {
	c := q.c
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", q.snap1, q.snap2)
	if err := c.BlockdevAdd(ctx, qcow2Target("snap2", q.snap2)); err != nil {
		t.Fatal(err)
	}
	err := c.Transaction(ctx, BackupAction(BackupArgs{
		JobID: "backup2", Device: q.top, Target: "snap2",
		Sync: SyncIncremental, Bitmap: "kvbox", BitmapMode: BitmapOnSuccess,
		AutoDismiss: Bool(false),
	}))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Cont(ctx); err != nil {
		t.Fatal(err)
	}
	job, err := c.WaitJob(q.wctx, "backup2", 5*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	// What the incremental copy wrote: the one 64 KiB write since snapshot 1.
	if job.CurrentProgress != 64<<10 {
		t.Errorf("backup2 copied %d bytes, want the %d written since backup1", job.CurrentProgress, 64<<10)
	}
	if err := c.BlockdevDel(ctx, "snap2"); err != nil {
		t.Fatal(err)
	}
	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if bm := findBitmap(nodes, q.top, "kvbox"); bm == nil || bm.Count != 0 {
		t.Fatalf("bitmap kvbox after an on-success incremental backup: %+v", bm)
	}
	if err := c.BlockDirtyBitmapRemove(ctx, q.top, "kvbox"); err != nil {
		t.Fatal(err)
	}
}

// checkImages: snap1 holds the point-in-time data, snap2 only the later
// write.
func (q *realQEMU) checkImages(t *testing.T) {
	run(t, "qemu-io", "-r", "-c", "read -P 0xcd 0 64k", "-c", "read -P 0x11 1M 64k", q.snap1)
	run(t, "qemu-io", "-r", "-c", "read -P 0xcd 0 64k", "-c", "read -P 0xef 1M 64k", "-c", "read -P 0x11 2M 64k", q.snap2)
	m := run(t, "qemu-img", "map", "--output=json", "-f", "qcow2", q.snap2)
	var extents []struct {
		Start, Length, Depth int64
		Data                 bool
	}
	if err := json.Unmarshal([]byte(m), &extents); err != nil {
		t.Fatal(err)
	}
	for _, e := range extents {
		if e.Depth == 0 && e.Data && e.Start < 1<<20 {
			t.Fatalf("incremental image holds data before 1M that was not written since snapshot 1: %+v", e)
		}
	}
}

// incoming starts a second QEMU on snap1 with the RAM file read-only and
// loads snapshot 1's state into it: it runs.
func (q *realQEMU) incoming(ctx context.Context, t *testing.T) {
	sock2 := filepath.Join(q.dir, "qmp2.sock")
	q2 := exec.Command("qemu-system-x86_64", qemuArgs(filepath.Join(q.dir, "memory"), "share=off,readonly=on,rom=off", q.snap1, sock2,
		"-incoming", "defer")...)
	if err := q2.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { q2.Process.Kill(); q2.Wait() }()
	m2 := dialQMP(t, sock2)
	defer m2.Disconnect()
	c2 := New(m2)
	if err := c2.MigrateSetCapabilities(ctx, map[string]bool{CapIgnoreShared: true}); err != nil {
		t.Fatal(err)
	}
	if err := c2.MigrateIncoming(ctx, "file:"+q.state); err != nil {
		t.Fatal(err)
	}
	if err := c2.WaitMigration(q.wctx, 5*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := c2.Cont(ctx); err != nil {
		t.Fatal(err)
	}
	if s, err := c2.QueryStatus(ctx); err != nil || !s.Running {
		t.Fatalf("clone status = %+v, %v", s, err)
	}
}

func qcow2Target(node, path string) map[string]any {
	return map[string]any{
		"driver":    "qcow2",
		"node-name": node,
		"backing":   nil,
		"file":      map[string]any{"driver": "file", "filename": path},
	}
}

func isClass(err error, class string) bool {
	e, ok := err.(*Error)
	return ok && e.Class == class
}

func assertActive(ctx context.Context, t *testing.T, c *Client, node string, want bool) {
	t.Helper()
	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		if n.NodeName == node {
			if n.Active == nil || *n.Active != want {
				t.Fatalf("node %s active = %v, want %v", node, n.Active, want)
			}
			return
		}
	}
	t.Fatalf("node %s not in query-named-block-nodes", node)
}

func findBitmap(nodes []BlockNode, node, name string) *DirtyBitmap {
	for _, n := range nodes {
		if n.NodeName != node {
			continue
		}
		for i := range n.DirtyBitmaps {
			if n.DirtyBitmaps[i].Name == name {
				return &n.DirtyBitmaps[i]
			}
		}
	}
	return nil
}
