package registry

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"libvirt.org/go/libvirtxml"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/statedir"
	"kvbox.dev/kvbox/testenv/gate"
	"kvbox.dev/kvbox/vmstate"
)

// The pushing host of the crafted artifacts below: its state dir, and its
// version of the image the snapshot stands on (as in a real push of a
// snapshot of a tiny box: snapshot/testdata/pushed-box.xml is one's
// domain XML).
const (
	srcState    = "/var/lib/kvbox-src"
	srcImageDir = srcState + "/images/tiny/v-20261205T175226.609027141"
	srcCompat   = `{"domain_type":"qemu","arch":"x86_64","machine":"pc-q35-10.0","cpu_mode":"custom","cpu_model":"qemu64","qemu":10000002,"libvirt":11003000}`
	stateSize   = 256<<20 + 1<<20 + 8192 // mapped-ram: the RAM at 1 MiB, device state after it
)

// file is one part of a crafted artifact.
type file struct {
	data     []byte
	apparent int64  // > len(data): a sparse file, data at its start
	blob     []byte // if set, the part's blob as is (a crafted encoding)
	ann      map[string]string
}

// artifact is a snapshot artifact made in a test, part by part.
type artifact struct {
	t     *testing.T
	files map[string]*file // by title
	ann   map[string]string
}

func qemuImg(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img %v: %v: %s", args, err, out)
	}
}

// qcow2 makes a qcow2 image with qemu-img create and returns its bytes
// (made once for each set of arguments).
func qcow2(t *testing.T, size string, opts ...string) []byte {
	t.Helper()
	key := size + " " + strings.Join(opts, " ")
	if b, ok := qcow2s.Load(key); ok {
		return b.([]byte)
	}
	p := filepath.Join(t.TempDir(), "disk.qcow2")
	qemuImg(t, append(append([]string{"create", "-q", "-f", "qcow2"}, opts...), p, size)...)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	qcow2s.Store(key, b)
	return b
}

var qcow2s sync.Map

// honest is the artifact a push of a snapshot of a tiny box makes.
func honest(t *testing.T) *artifact {
	t.Helper()
	gate.Tools(t, "qemu-img")
	xml, err := os.ReadFile("../snapshot/testdata/pushed-box.xml")
	if err != nil {
		t.Fatal(err)
	}
	meta := map[string]any{
		"name": "s1", "box": "p1", "box_uuid": "25aabed7-1ebd-466b-b6a4-fc3852eb81ab", "created": "2026-12-05T17:52:56Z",
		"image": "tiny", "base_disk": srcImageDir + "/disk.qcow2", "base_format": "qcow2",
		"guest_boot_id": "7f09e76f-6778-4abd-8139-109482f8a78c",
		"memory":        map[string]any{"file": "state", "offset": 1 << 20},
		"cpus":          1, "memory_bytes": 256 << 20, "disk_bytes": 1 << 30, "bitmap": "kvbox-s1",
	}
	mb, _ := json.Marshal(meta)
	img := map[string]any{
		"name": "tiny", "disk": srcImageDir + "/disk.qcow2", "format": "qcow2",
		"kernel": srcImageDir + "/vmlinuz", "initrd": srcImageDir + "/initrd.img",
		"cmdline": "console=ttyS0 root=/dev/vda rw quiet panic=-1 init_on_alloc=0", "virtual_size_bytes": 512 << 20,
		"agent": "yes", "created": "2026-12-05T17:52:26Z",
	}
	ib, _ := json.Marshal(img)
	return &artifact{t: t,
		files: map[string]*file{
			"snapshot/domain.xml":    {data: xml},
			"snapshot/snapshot.json": {data: mb},
			"snapshot/agent.token":   {data: bytes.Repeat([]byte{7}, 32)},
			"snapshot/disk.qcow2":    {data: qcow2(t, "1G", "-u", "-F", "qcow2", "-b", srcImageDir+"/disk.qcow2")},
			"snapshot/state":         {data: []byte("QEVM state and RAM"), apparent: stateSize},
			"image/disk.qcow2":       {data: qcow2(t, "512M")},
			"image/vmlinuz":          {data: []byte("a kernel")},
			"image/initrd.img":       {data: []byte("an initrd")},
			"image-meta/image.json":  {data: ib},
		},
		ann: map[string]string{
			AnnotKind: ArtifactType, AnnotSnapshot: "s1", AnnotStateDir: srcState, AnnotImageDir: srcImageDir,
			AnnotImageName: "tiny", AnnotCompat: srcCompat,
		},
	}
}

// edit changes a text part.
func (a *artifact) edit(title, old, repl string) *artifact {
	a.t.Helper()
	f := a.files[title]
	if !bytes.Contains(f.data, []byte(old)) {
		a.t.Fatalf("%s has no %q", title, old)
	}
	f.data = bytes.Replace(f.data, []byte(old), []byte(repl), 1)
	return a
}

// json changes a field of a JSON part.
func (a *artifact) json(title string, set func(m map[string]any)) *artifact {
	a.t.Helper()
	m := map[string]any{}
	if err := json.Unmarshal(a.files[title].data, &m); err != nil {
		a.t.Fatal(err)
	}
	set(m)
	a.files[title].data, _ = json.Marshal(m)
	return a
}

// manifest encodes every part into the cache and returns the manifest.
func (a *artifact) manifest(c cache) *v1.Manifest {
	t := a.t
	t.Helper()
	m := &v1.Manifest{SchemaVersion: 2, Annotations: a.ann}
	dir := t.TempDir()
	for title, f := range a.files {
		var dig v1.Hash
		var n, apparent, data int64
		var err error
		if f.blob != nil {
			dig, n, err = c.put(func(w io.Writer) error { _, err := w.Write(f.blob); return err })
			apparent, data = int64(len(f.data)), int64(len(f.data))
		} else {
			p := filepath.Join(dir, strings.ReplaceAll(title, "/", "_"))
			writeSparse(t, p, max(f.apparent, int64(len(f.data))), map[int64][]byte{0: f.data})
			dig, n, err = c.put(func(w io.Writer) error {
				var err error
				apparent, data, err = encodeSparse(p, w)
				return err
			})
		}
		if err != nil {
			t.Fatal(err)
		}
		ann := map[string]string{AnnotTitle: title, AnnotApparent: strconv.FormatInt(apparent, 10), AnnotDataBytes: strconv.FormatInt(data, 10)}
		for k, v := range f.ann {
			ann[k] = v
		}
		mt := PartType
		if !strings.HasPrefix(title, "snapshot/") {
			mt = ImagePartType
		}
		m.Layers = append(m.Layers, v1.Descriptor{MediaType: types.MediaType(mt), Size: n, Digest: dig, Annotations: ann})
	}
	return m
}

// qemuGID stands for QEMU's group in the tests' state dirs.
const qemuGID = 64123

// pull installs the artifact into a fresh state dir as snapshot "pulled".
// Its images/ and snapshots/ are setgid to qemuGID, as kvbox makes them.
func (a *artifact) pull() (string, snapshot.Snapshot, error) {
	a.t.Helper()
	stateDir := a.t.TempDir()
	for _, d := range []string{"images", "snapshots"} {
		p := filepath.Join(stateDir, d)
		os.Mkdir(p, 0o750)
		os.Chown(p, 0, qemuGID)
		os.Chmod(p, 0o750|os.ModeSetgid)
	}
	c := cache{statedir.Layout{Root: stateDir}.RegistryCache()}
	os.MkdirAll(c.dir, 0o700)
	m := a.manifest(c)
	st := snapshot.Store{Dir: filepath.Join(stateDir, "snapshots")}
	s, _, err := install(context.Background(), c, st, stateDir, "pulled", m, Options{Emulator: "/usr/bin/qemu-system-x86_64"})
	return stateDir, s, err
}

// refused pulls the artifact and wants it refused, in one line that
// says want, with nothing left in the state dir's snapshots/ and images/.
func (a *artifact) refused(want string) {
	a.t.Helper()
	stateDir, _, err := a.pull()
	if err == nil {
		a.t.Errorf("the artifact was installed; want it refused with %q", want)
		return
	}
	if !errors.Is(err, base.ErrInvalid) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
		a.t.Errorf("refused with %q; want one line with %q (an ErrInvalid)", err, want)
	}
	for _, d := range []string{"snapshots", "images"} {
		ents, _ := os.ReadDir(filepath.Join(stateDir, d))
		for _, e := range ents {
			a.t.Errorf("a refused pull left %s/%s", d, e.Name())
		}
	}
	a.t.Logf("refused: %v", err)
}

// An honest artifact installs, with this host's paths everywhere and
// nothing of the pushing host's left but in its compatibility record.
func TestPullInstallsHonestArtifact(t *testing.T) {
	stateDir, s, err := honest(t).pull()
	if err != nil {
		t.Fatal(err)
	}
	if s.Name != "pulled" || filepath.Dir(s.BaseDisk) != filepath.Join(stateDir, "images/tiny/v-20261205T175226.609027141") {
		t.Errorf("installed snapshot %+v", s)
	}
	for _, f := range []string{"domain.xml", "snapshot.json"} {
		b, _ := os.ReadFile(s.Path(f))
		if bytes.Contains(b, []byte(srcState)) {
			t.Errorf("%s names the pushing host's state dir:\n%s", f, b)
		}
	}
	// QEMU reads the base image and the snapshot through its group.
	if os.Geteuid() == 0 {
		for _, f := range []string{filepath.Join(filepath.Dir(s.BaseDisk), "vmlinuz"), s.BaseDisk, s.Path("state"), s.Path("disk.qcow2")} {
			if fi, err := os.Stat(f); err != nil || fi.Sys().(*syscall.Stat_t).Gid != qemuGID {
				t.Errorf("%s is not in QEMU's group (%v)", f, err)
			}
		}
	}
	img, _ := os.ReadFile(filepath.Join(stateDir, "images/tiny/image.json"))
	if bytes.Contains(img, []byte(srcState)) || !bytes.Contains(img, []byte(filepath.Join(stateDir, "images/tiny"))) {
		t.Errorf("image.json:\n%s", img)
	}
	disk := s.Path(snapshot.DiskFile)
	out, err := exec.Command("qemu-img", "info", "--output=json", "-U", disk).Output()
	if err != nil || !bytes.Contains(out, []byte(`"backing-filename": "`+s.BaseDisk+`"`)) {
		t.Errorf("the disk's backing file is not this host's copy of the base image: %v\n%s", err, out)
	}
	// a clone's XML derives from what was installed
	x, _ := os.ReadFile(s.Path(snapshot.DomainXMLFile))
	cx, err := vmstate.RestoreXML(string(x), vmstate.RestoreSpec{Name: "c1", Meta: domain.Meta{Dir: "/b/c1", MAC: "52:54:00:00:00:01", IP: "172.30.0.9", Bridge: "kvbox0"},
		Disk: "/b/c1/disk.qcow2", MemPath: s.Path("state"), MemOffset: s.Memory.Offset, MemBytes: s.MemoryBytes})
	if err != nil {
		t.Fatalf("clone XML of the pulled snapshot: %v", err)
	}
	if strings.Contains(cx, srcState) {
		t.Errorf("a clone's XML names the pushing host's state dir:\n%s", cx)
	}
}

// A domain XML that passes QEMU arguments of its own: -netdev user would
// give the guest a network past the bridge and every rule, -drive another
// tenant's disk.
func TestPullRefusesQemuArgs(t *testing.T) {
	const ram = `<qemu:arg value='-machine'/>`
	for _, extra := range []string{
		`<qemu:arg value='-netdev'/><qemu:arg value='user,id=escape'/><qemu:arg value='-device'/><qemu:arg value='virtio-net-pci,netdev=escape'/>`,
		`<qemu:arg value='-drive'/><qemu:arg value='file=/var/lib/kvbox/boxes/other/disk.qcow2,if=virtio'/>`,
	} {
		honest(t).edit("snapshot/domain.xml", ram, extra+ram).refused("passes QEMU the argument")
	}
	honest(t).edit("snapshot/domain.xml", ram, `<qemu:env name='LD_PRELOAD' value='/tmp/x.so'/>`+ram).refused("sets QEMU's environment")
	honest(t).edit("snapshot/domain.xml", "</qemu:commandline>", `</qemu:commandline><qemu:override><qemu:device alias='net0'><qemu:frontend><qemu:property name='romfile' type='string' value='/etc/shadow'/></qemu:frontend></qemu:device></qemu:override>`).
		refused("overrides properties of QEMU device")
}

// Devices beyond kvbox's fixed set: a second disk, a file chardev (QEMU
// opens it O_TRUNC), a host device, a host folder, another network.
func TestPullRefusesDevices(t *testing.T) {
	for _, tc := range []struct{ dev, want string }{
		{`<disk type='file' device='disk'><driver name='qemu' type='raw'/><source file='/var/lib/kvbox/boxes/other/disk.qcow2'/><target dev='vdb' bus='virtio'/></disk>`, "has 2 disks"},
		{`<disk type='block' device='lun'><source dev='/dev/sda'/><target dev='sda' bus='scsi'/></disk>`, "has 2 disks"},
		{`<channel type='file'><source path='/etc/shadow'/><target type='virtio' name='org.kvbox.agent.9'/></channel>`, "channel that is not one of kvbox's agent sockets"},
		{`<channel type='tcp'><source mode='connect' host='127.0.0.1' port='22'/><target type='guestfwd' address='10.0.2.1' port='22'/></channel>`, "channel that is not one of kvbox's agent sockets"},
		{`<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0' bus='0' slot='2' function='0'/></source></hostdev>`, "has a <hostdev> device"},
		{`<filesystem type='mount' accessmode='passthrough'><source dir='/'/><target dir='host'/></filesystem>`, "has a <filesystem> device"},
		{`<interface type='user'><model type='virtio'/></interface>`, "network interfaces"},
		{`<input type='evdev'><source dev='/dev/input/event0'/></input>`, "input device"},
		{`<watchdog model='i6300esb' action='dump'/>`, "watchdog whose action is"},
		{`<audio id='2' type='file' path='/etc/shadow'/>`, "audio backend other than none"},
		{`<video><model type='vga'/></video>`, "has a <video> device"},
	} {
		honest(t).edit("snapshot/domain.xml", "</devices>", tc.dev+"</devices>").refused(tc.want)
	}
	honest(t).edit("snapshot/domain.xml", "<backend model='random'>/dev/urandom</backend>", "<backend model='random'>/dev/mem</backend>").refused("rng device fed by")
	honest(t).edit("snapshot/domain.xml", "<backend model='random'>/dev/urandom</backend>", "<backend model='egd' type='tcp'><source mode='connect' host='127.0.0.1' port='1'/></backend>").refused("rng device fed by")
	honest(t).edit("snapshot/domain.xml", "<serial type='pty'>", "<serial type='file'><source path='/etc/passwd'/>").refused("serial port that is not a pty")
	honest(t).edit("snapshot/domain.xml", "<console type='pty'>", "<console type='file'><source path='/etc/passwd'/>").refused("console that is not a pty")
	honest(t).edit("snapshot/domain.xml", "<source bridge='kvbox0'/>", "<source bridge='kvbox0'/><script path='/tmp/x.sh'/>").refused("network interface with <script>")
	honest(t).edit("snapshot/domain.xml", "/var/lib/kvbox-src/libexec/qemu-system-x86_64", "/tmp/evil").refused(`names the emulator "/tmp/evil"`)
	honest(t).edit("snapshot/domain.xml", "<os>", "<os><loader readonly='yes' type='pflash'>/etc/shadow</loader>").refused("has <os><loader>")
	honest(t).edit("snapshot/domain.xml", srcImageDir+"/vmlinuz", "/boot/vmlinuz").refused("boots the kernel")
	honest(t).edit("snapshot/domain.xml", "<devices>", "<memoryBacking><source type='file'/></memoryBacking><devices>").refused("has <memoryBacking>")
	honest(t).edit("snapshot/domain.xml", "<devices>", "<sysinfo type='fwcfg'><entry name='opt/x' file='/etc/shadow'/></sysinfo><devices>").refused("has <sysinfo>")
	honest(t).edit("snapshot/domain.xml", "<domain type='qemu'", "<domain type='kvm'").refused("asks for domain type")
}

// The box group the pushing host's box was in is not this host's: a
// pulled snapshot's clones join no group.
func TestPullDropsGroup(t *testing.T) {
	_, s, err := honest(t).edit("snapshot/domain.xml", "<bridge>kvbox0</bridge>", "<bridge>kvbgdeadbeef</bridge><group>web</group>").pull()
	if err != nil {
		t.Fatal(err)
	}
	x, _ := os.ReadFile(s.Path(snapshot.DomainXMLFile))
	if m, _, err := domain.MetaOfXML(string(x)); err != nil || m.Group != "" {
		t.Fatalf("the pulled snapshot is in group %q (%v): its clones would join this host's group of that name", m.Group, err)
	}
}

// qcow2 files may name another file: an external data file, or a backing
// file anywhere (a clone read another snapshot's RAM through its disk).
func TestPullRefusesImageHeaders(t *testing.T) {
	other := filepath.Join(t.TempDir(), "data")
	honest(t).set("snapshot/disk.qcow2", qcow2(t, "1G", "-o", "data_file="+other)).refused("external data file")
	honest(t).set("snapshot/disk.qcow2", qcow2(t, "1G", "-u", "-F", "raw", "-b", "/var/lib/kvbox/snapshots/other/state")).
		refused(`backing file "/var/lib/kvbox/snapshots/other/state"`)
	honest(t).set("image/disk.qcow2", qcow2(t, "512M", "-u", "-F", "raw", "-b", "/etc/shadow")).refused(`backing file "/etc/shadow"`)
	honest(t).set("image/disk.qcow2", append([]byte("QFI\xfb\x00\x00\x00\x07"), make([]byte, 120)...)).refused("qcow2 version 7")
	honest(t).set("snapshot/disk.qcow2", qcow2(t, "2G", "-u", "-F", "qcow2", "-b", srcImageDir+"/disk.qcow2")).refused("virtual size")
}

func (a *artifact) set(title string, data []byte) *artifact {
	a.files[title] = &file{data: data}
	return a
}

// snapshot.json and image.json name files and formats: only the
// artifact's own files, in their folders, in kvbox's formats.
func TestPullRefusesMetadataPaths(t *testing.T) {
	honest(t).json("snapshot/snapshot.json", func(m map[string]any) {
		m["memory"] = map[string]any{"file": "../other/state", "offset": 0}
	}).refused("memory file")
	// The RAM is in state (mapped-ram); a separate memory file is no part
	// of a snapshot.
	a := honest(t)
	a.files["snapshot/memory"] = &file{data: make([]byte, 4096), apparent: 256 << 20}
	a.json("snapshot/snapshot.json", func(m map[string]any) {
		m["memory"] = map[string]any{"file": "memory", "offset": 0}
	}).refused("snapshot/memory")
	honest(t).json("snapshot/snapshot.json", func(m map[string]any) { m["base_disk"] = "/etc/shadow" }).refused("base disk")
	honest(t).json("image-meta/image.json", func(m map[string]any) { m["disk"] = "/dev/sda"; m["format"] = "host_device" }).refused("image.json")
	honest(t).json("image-meta/image.json", func(m map[string]any) { m["kernel"] = "/etc/shadow" }).refused("image.json")
	a = honest(t)
	a.files["snapshot/run.sh"] = &file{data: []byte("#!/bin/sh")}
	a.refused("snapshot/run.sh")
	a = honest(t)
	a.files["extra/x"] = &file{data: []byte("x")}
	a.refused("extra/x")
}

// A snapshot's agent token is what its clones' first contact presents: an
// artifact without one was installed and then every clone of it refused.
// It is refused at the pull, and so is one whose token is not a token.
func TestPullRefusesArtifactWithoutToken(t *testing.T) {
	a := honest(t)
	delete(a.files, "snapshot/agent.token")
	a.refused("no snapshot/agent.token")
	a = honest(t)
	a.files["snapshot/agent.token"] = &file{data: []byte("short")}
	a.refused("not a token")
}

// bomb is a part's blob that says it is size bytes, all of them data,
// in a few KB: an extent of zeros, compressed.
func bomb(t *testing.T, size int64) []byte {
	var b bytes.Buffer
	zw, _ := newEncoder(&b)
	hdr := append([]byte{}, sparseMagic[:]...)
	hdr = binary.BigEndian.AppendUint64(hdr, uint64(size))
	hdr = binary.BigEndian.AppendUint64(hdr, 1)
	hdr = binary.BigEndian.AppendUint64(hdr, 0)
	hdr = binary.BigEndian.AppendUint64(hdr, uint64(size))
	zw.Write(hdr)
	zero := make([]byte, 1<<20)
	for n := int64(0); n < size; n += int64(len(zero)) {
		zw.Write(zero[:min(int64(len(zero)), size-n)])
	}
	zw.Close()
	return b.Bytes()
}

// Nothing bounded what a blob expanded to: a part that says it is a few
// bytes but decodes to 64 MiB is refused before anything is written, and
// so is a part larger than the host's free space.
func TestPullBoundsSizes(t *testing.T) {
	a := honest(t)
	a.files["image/vmlinuz"].blob = bomb(t, 64<<20) // annotated as the 8 bytes it had
	a.refused("image/vmlinuz")

	// A part larger than its kind of file may be.
	a = honest(t)
	a.files["snapshot/agent.token"].ann = map[string]string{AnnotApparent: "1048576", AnnotDataBytes: "1048576"}
	a.refused("snapshot/agent.token")

	// A disk that says what it is, more than this filesystem has free:
	// refused before a byte is written.
	a = honest(t)
	free, err := FreeSpace(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	disk := (4*free>>30 + 1) << 30 // twice the free space: other processes may free some meanwhile
	a.json("snapshot/snapshot.json", func(m map[string]any) { m["disk_bytes"] = disk })
	a.files["snapshot/disk.qcow2"].ann = map[string]string{AnnotApparent: strconv.FormatInt(2*free, 10), AnnotDataBytes: strconv.FormatInt(2*free, 10)}
	a.refused("free")
}

// A pull that fails at its last step, the snapshot's rename, takes back
// the image version it had put in place.
func TestPullRollsBack(t *testing.T) {
	a := honest(t)
	stateDir := t.TempDir()
	c := cache{statedir.Layout{Root: stateDir}.RegistryCache()}
	os.MkdirAll(c.dir, 0o700)
	m := a.manifest(c)
	// something else at the snapshot's name (no snapshot: no snapshot.json)
	os.MkdirAll(filepath.Join(stateDir, "snapshots", "pulled", "x"), 0o700)
	st := snapshot.Store{Dir: filepath.Join(stateDir, "snapshots")}
	if _, _, err := install(context.Background(), c, st, stateDir, "pulled", m, Options{}); err == nil {
		t.Fatal("installed over a folder")
	}
	if ents, _ := os.ReadDir(filepath.Join(stateDir, "images")); len(ents) != 0 {
		t.Errorf("a failed pull left images/%s", ents[0].Name())
	}
	ents, _ := os.ReadDir(filepath.Join(stateDir, "snapshots"))
	if len(ents) != 1 {
		t.Errorf("a failed pull left %d entries in snapshots/", len(ents))
	}
}

// The installed domain XML is kvbox's own: nothing of what the pushed one
// carried beyond the allow-list.
func TestPullRebuildsDomainXML(t *testing.T) {
	_, s, err := honest(t).edit("snapshot/domain.xml", "<on_crash>destroy</on_crash>",
		"<on_crash>destroy</on_crash><description>hello</description><resource><partition>/machine/evil</partition></resource>").pull()
	if err != nil {
		t.Fatal(err)
	}
	x, _ := os.ReadFile(s.Path(snapshot.DomainXMLFile))
	var d libvirtxml.Domain
	if err := d.Unmarshal(string(x)); err != nil {
		t.Fatal(err)
	}
	if d.Description != "" || d.Resource != nil || d.SecLabel != nil {
		t.Errorf("the installed domain XML keeps what the artifact chose:\n%s", x)
	}
}

// A host's caps on a pulled snapshot's size (Options.MaxCPUs,
// MaxMemoryBytes, MaxDiskBytes) refuse a larger snapshot from its
// snapshot.json, or from its parts' declared sizes, before its memory and
// disk are fetched; within them it installs.
func TestPullRefusesOverHostCaps(t *testing.T) {
	install1 := func(a *artifact, o Options) error {
		stateDir := t.TempDir()
		c := cache{statedir.Layout{Root: stateDir}.RegistryCache()}
		os.MkdirAll(c.dir, 0o700)
		m := a.manifest(c)
		st := snapshot.Store{Dir: filepath.Join(stateDir, "snapshots")}
		o.Emulator = "/usr/bin/qemu-system-x86_64"
		_, _, err := install(context.Background(), c, st, stateDir, "pulled", m, o)
		return err
	}
	for _, tc := range []struct {
		name string
		edit func(*artifact)
		o    Options
		want string
	}{
		{"vCPUs", func(a *artifact) { a.json("snapshot/snapshot.json", func(m map[string]any) { m["cpus"] = 4 }) }, Options{MaxCPUs: 2}, "4 vCPUs"},
		{"RAM", nil, Options{MaxMemoryBytes: 128 << 20}, "256.0 MiB of RAM"},
		{"disk", nil, Options{MaxDiskBytes: 512 << 20}, "disk of 1.00 GiB"},
		{"a state part larger than the RAM cap allows", func(a *artifact) {
			a.files["snapshot/state"].ann = map[string]string{AnnotApparent: strconv.FormatInt(4<<30, 10), AnnotDataBytes: "18"}
		}, Options{MaxMemoryBytes: 1 << 30}, "snapshot/state says it is 4.00 GiB"},
	} {
		a := honest(t)
		if tc.edit != nil {
			tc.edit(a)
		}
		err := install1(a, tc.o)
		if !errors.Is(err, base.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want a refusal saying %q", tc.name, err, tc.want)
		}
	}
	if err := install1(honest(t), Options{MaxCPUs: 1, MaxMemoryBytes: 256 << 20, MaxDiskBytes: 1 << 30}); err != nil {
		t.Errorf("a snapshot at the caps: %v", err)
	}
}
