//go:build e2e

package testenv

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	crname "github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"

	"kvbox.dev/kvbox/registry"
)

// registryRepo is the repository folder of this run's artifacts in the
// shared test registry (KVBOX_E2E_REPO: two runs at once keep apart).
var registryRepo = envOr("KVBOX_E2E_REPO", "kvbox-e2e")

// A kvbox part is a zstd stream: "KVBXSPR1", the file's size, its extents
// (offset, length), then their bytes (registry/sparse.go). The test reads
// and writes them itself: it crafts what a hostile pusher would.

// partBytes decodes a part into the file it holds.
func partBytes(t *testing.T, blob []byte) []byte {
	t.Helper()
	zr, err := zstd.NewReader(bytes.NewReader(blob))
	if err != nil {
		t.Fatal(err)
	}
	defer zr.Close()
	raw, err := io.ReadAll(zr)
	if err != nil || len(raw) < 24 || string(raw[:8]) != "KVBXSPR1" {
		t.Fatalf("not a kvbox part: %v", err)
	}
	size, n := binary.BigEndian.Uint64(raw[8:]), binary.BigEndian.Uint64(raw[16:])
	out := make([]byte, size)
	data := raw[24+16*n:]
	for i := uint64(0); i < n; i++ {
		off, l := binary.BigEndian.Uint64(raw[24+16*i:]), binary.BigEndian.Uint64(raw[32+16*i:])
		copy(out[off:off+l], data[:l])
		data = data[l:]
	}
	return out
}

// encodePart encodes a file as one extent of size bytes, the rest hole:
// the blob says it is a file of size bytes, whatever the manifest says.
func encodePart(t *testing.T, data []byte, size int64) []byte {
	var b bytes.Buffer
	zw, _ := zstd.NewWriter(&b, zstd.WithEncoderLevel(zstd.SpeedFastest))
	hdr := binary.BigEndian.AppendUint64([]byte("KVBXSPR1"), uint64(size))
	hdr = binary.BigEndian.AppendUint64(hdr, 1)
	hdr = binary.BigEndian.AppendUint64(hdr, 0)
	hdr = binary.BigEndian.AppendUint64(hdr, uint64(len(data)))
	zw.Write(hdr)
	zw.Write(data)
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// bombPart is a blob of a few KB that decodes to size bytes of data.
func bombPart(t *testing.T, size int64) []byte {
	var b bytes.Buffer
	zw, _ := zstd.NewWriter(&b, zstd.WithEncoderLevel(zstd.SpeedFastest))
	hdr := binary.BigEndian.AppendUint64([]byte("KVBXSPR1"), uint64(size))
	for _, v := range []uint64{1, 0, uint64(size)} {
		hdr = binary.BigEndian.AppendUint64(hdr, v)
	}
	zw.Write(hdr)
	zero := make([]byte, 1<<20)
	for n := int64(0); n < size; n += 1 << 20 {
		zw.Write(zero)
	}
	zw.Close()
	return b.Bytes()
}

// pushed is an artifact in the registry, read back to be crafted from.
type pushed struct {
	t      *testing.T
	img    v1.Image
	m      *v1.Manifest
	blobs  map[string][]byte // replaced parts' blobs, by title
	anns   map[string]map[string]string
	annots map[string]string
}

func readPushed(t *testing.T, ref string) *pushed {
	t.Helper()
	r, err := crname.ParseReference(ref, crname.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(r)
	if err != nil {
		t.Fatalf("read %s back: %v", ref, err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	p := &pushed{t: t, img: img, m: m, blobs: map[string][]byte{}, anns: map[string]map[string]string{}, annots: map[string]string{}}
	for k, v := range m.Annotations {
		p.annots[k] = v
	}
	return p
}

func (p *pushed) layer(title string) v1.Descriptor {
	for _, l := range p.m.Layers {
		if l.Annotations["org.opencontainers.image.title"] == title {
			return l
		}
	}
	p.t.Fatalf("the artifact has no part %s", title)
	return v1.Descriptor{}
}

// file is the content of a part of the pushed artifact.
func (p *pushed) file(title string) []byte {
	l, err := p.img.LayerByDigest(p.layer(title).Digest)
	if err != nil {
		p.t.Fatal(err)
	}
	rc, err := l.Compressed()
	if err != nil {
		p.t.Fatal(err)
	}
	defer rc.Close()
	b, _ := io.ReadAll(rc)
	return partBytes(p.t, b)
}

// set replaces a part by data, its manifest sizes saying what it is.
func (p *pushed) set(title string, data []byte) *pushed {
	p.blobs[title] = encodePart(p.t, data, int64(len(data)))
	p.anns[title] = map[string]string{"dev.kvbox.apparent-size": strconv.Itoa(len(data)), "dev.kvbox.data-bytes": strconv.Itoa(len(data))}
	return p
}

// edit replaces old by repl in a text part.
func (p *pushed) edit(title, old, repl string) *pushed {
	b := p.file(title)
	if !bytes.Contains(b, []byte(old)) {
		p.t.Fatalf("%s has no %q:\n%s", title, old, b)
	}
	return p.set(title, bytes.Replace(b, []byte(old), []byte(repl), 1))
}

// push writes the crafted artifact to ref.
func (p *pushed) push(ref string) string {
	p.t.Helper()
	out := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	out = mutate.ConfigMediaType(out, "application/vnd.kvbox.snapshot.config.v1+json")
	var adds []mutate.Addendum
	for _, l := range p.m.Layers {
		title := l.Annotations["org.opencontainers.image.title"]
		ann := map[string]string{}
		for k, v := range l.Annotations {
			ann[k] = v
		}
		for k, v := range p.anns[title] {
			ann[k] = v
		}
		var layer v1.Layer
		if b, ok := p.blobs[title]; ok {
			layer = static.NewLayer(b, l.MediaType)
		} else {
			var err error
			if layer, err = p.img.LayerByDigest(l.Digest); err != nil {
				p.t.Fatal(err)
			}
		}
		adds = append(adds, mutate.Addendum{Layer: layer, MediaType: l.MediaType, Annotations: ann})
	}
	out, err := mutate.Append(out, adds...)
	if err != nil {
		p.t.Fatal(err)
	}
	out = mutate.Annotations(out, p.annots).(v1.Image)
	r, _ := crname.ParseReference(ref, crname.Insecure)
	if err := remote.Write(r, out); err != nil {
		p.t.Fatalf("push the crafted artifact to %s: %v", ref, err)
	}
	return ref
}

func jsonEdit(t *testing.T, b []byte, set func(m map[string]any)) []byte {
	m := map[string]any{}
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	set(m)
	out, _ := json.Marshal(m)
	return out
}

func qcow2File(t *testing.T, size string, opts ...string) []byte {
	p := filepath.Join(t.TempDir(), "disk.qcow2")
	if out, err := exec.Command("qemu-img", append(append([]string{"create", "-q", "-f", "qcow2"}, opts...), p, size)...).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	b, _ := os.ReadFile(p)
	return b
}

// runDomains are this run's domains (other runs share the libvirtd).
func runDomains(t *testing.T) []string {
	var out []string
	for d := range domains(t) {
		if strings.HasPrefix(d, runID) {
			out = append(out, d)
		}
	}
	slices.Sort(out)
	return out
}

func entries(dir string) []string {
	var out []string
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestPullHostileSnapshot: a real snapshot of a tiny box goes to the
// registry; artifacts crafted from it, each carrying one hostile thing
// (QEMU arguments, a second disk, a file chardev, a host device, a host
// folder, an emulator, a qcow2 data file or backing file elsewhere, a
// memory file outside its folder, an image.json naming a host device, a
// blob that expands past what it declared, a disk larger than the host's
// free space), are pulled into a second host's state dir: each is refused
// in one line, and leaves no snapshot folder, no image version and no
// domain. The honest artifact pulls and its clone runs the source's
// processes; a pulled snapshot naming a box group joins no group here.
func TestPullHostileSnapshot(t *testing.T) {
	needRegistry(t)
	src, snapName := name(t, "hsrc"), name(t, "hsnap")
	newBox(t, src)
	inBox(t, src, "setsid sleep 77777 </dev/null >/dev/null 2>&1 & echo hostile-"+src+" > /marker; sync")
	newSnapshot(t, src, snapName)
	repo := testRegistry + "/" + registryRepo + "/" + runID + "-hostile"
	honestRef := repo + ":honest"
	push(t, nil, snapName, honestRef)
	mustKvbox(t, "rm", "--force", src) // its disk is what a hostile qcow2 names below
	orig := readPushed(t, honestRef)
	srcState := orig.annots["dev.kvbox.state-dir"]
	h2 := host2(t, "h", freeSubnet(t))
	snaps, images := filepath.Join(dirOf(h2), "snapshots"), filepath.Join(dirOf(h2), "images")
	doms := runDomains(t)
	free, err := registry.FreeSpace(dirOf(h2))
	if err != nil {
		t.Fatal(err)
	}
	otherState := filepath.Join(stateDir, "snapshots", snapName, "state")

	for i, tc := range []struct {
		what  string
		craft func(p *pushed)
		want  string
	}{
		{"-netdev user", func(p *pushed) {
			p.edit("snapshot/domain.xml", "<qemu:arg value='-machine'/>", "<qemu:arg value='-netdev'/><qemu:arg value='user,id=out'/><qemu:arg value='-device'/><qemu:arg value='virtio-net-pci,netdev=out'/><qemu:arg value='-machine'/>")
		}, `passes QEMU the argument "-netdev"`},
		{"-drive of another disk", func(p *pushed) {
			p.edit("snapshot/domain.xml", "<qemu:arg value='-machine'/>", "<qemu:arg value='-drive'/><qemu:arg value='file="+otherState+",format=raw,if=virtio'/><qemu:arg value='-machine'/>")
		}, `passes QEMU the argument "-drive"`},
		{"a second disk", func(p *pushed) {
			p.edit("snapshot/domain.xml", "</devices>", "<disk type='file' device='disk'><driver name='qemu' type='raw'/><source file='"+otherState+"'/><target dev='vdb' bus='virtio'/></disk></devices>")
		}, "has 2 disks"},
		{"a file chardev", func(p *pushed) {
			p.edit("snapshot/domain.xml", "<serial type='pty'>", "<serial type='file'><source path='"+filepath.Join(stateDir, "lock")+"'/>")
		}, "serial port that is not a pty"},
		{"a hostdev", func(p *pushed) {
			p.edit("snapshot/domain.xml", "</devices>", "<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0' bus='0' slot='2' function='0'/></source></hostdev></devices>")
		}, "has a <hostdev> device"},
		{"a filesystem", func(p *pushed) {
			p.edit("snapshot/domain.xml", "</devices>", "<filesystem type='mount' accessmode='passthrough'><source dir='/'/><target dir='host'/></filesystem></devices>")
		}, "has a <filesystem> device"},
		{"an emulator", func(p *pushed) {
			x := string(p.file("snapshot/domain.xml"))
			i, j := strings.Index(x, "<emulator>"), strings.Index(x, "</emulator>")
			if i < 0 || j < i {
				x = strings.Replace(x, "<devices>", "<devices><emulator>/tmp/evil</emulator>", 1)
			} else {
				x = x[:i] + "<emulator>/tmp/evil" + x[j:]
			}
			p.set("snapshot/domain.xml", []byte(x))
		}, `names the emulator "/tmp/evil"`},
		{"a qcow2 data file", func(p *pushed) {
			p.set("snapshot/disk.qcow2", qcow2File(t, "1G", "-o", "data_file="+filepath.Join(t.TempDir(), "data")))
		}, "external data file"},
		{"a qcow2 backing file elsewhere", func(p *pushed) {
			p.set("snapshot/disk.qcow2", qcow2File(t, "1G", "-u", "-F", "raw", "-b", otherState))
		}, "names the backing file"},
		{"a memory file outside its folder", func(p *pushed) {
			p.set("snapshot/snapshot.json", jsonEdit(t, p.file("snapshot/snapshot.json"), func(m map[string]any) {
				m["memory"] = map[string]any{"file": "../" + snapName + "/state", "offset": 1 << 20}
			}))
		}, "names the memory file"},
		{"image.json naming a host device", func(p *pushed) {
			p.set("image-meta/image.json", jsonEdit(t, p.file("image-meta/image.json"), func(m map[string]any) {
				m["disk"], m["format"] = "/dev/sda", "host_device"
			}))
		}, "image.json names the disk"},
		{"a blob that expands past its declared size", func(p *pushed) {
			p.blobs["image/vmlinuz"] = bombPart(t, 256<<20)
		}, "the part is a file of 268435456 bytes"},
		{"a disk larger than the free space", func(p *pushed) {
			// twice the free space: other runs on this machine free some meanwhile
			disk := (4*free>>30 + 1) << 30
			p.set("snapshot/snapshot.json", jsonEdit(t, p.file("snapshot/snapshot.json"), func(m map[string]any) { m["disk_bytes"] = disk }))
			n := strconv.FormatInt(2*free, 10)
			p.anns["snapshot/disk.qcow2"] = map[string]string{"dev.kvbox.apparent-size": n, "dev.kvbox.data-bytes": n}
		}, "free"},
	} {
		p := readPushed(t, honestRef)
		tc.craft(p)
		ref := p.push(fmt.Sprintf("%s:case%d", repo, i))
		r := kvbox(t, append(h2, "snapshots", "pull", "--insecure", ref, name(t, fmt.Sprintf("bad%d", i)))...)
		line := strings.TrimSpace(lastLine(r.stderr))
		if r.code != 2 || !strings.Contains(line, tc.want) || !strings.Contains(line, "refused") {
			t.Errorf("%s: pull exited %d with %q; want exit 2 and a line with %q\n%s", tc.what, r.code, line, tc.want, r.stderr)
		}
		t.Logf("%s: %s", tc.what, line)
		if l := entries(snaps); len(l) != 0 {
			t.Errorf("%s: a refused pull left snapshots/%v", tc.what, l)
		}
		if l := entries(images); len(l) != 0 {
			t.Errorf("%s: a refused pull left images/%v (%v)", tc.what, l, entries(filepath.Join(images, "tiny")))
		}
		if d := runDomains(t); !slices.Equal(d, doms) {
			t.Errorf("%s: domains before %v, after %v", tc.what, doms, d)
		}
		os.RemoveAll(filepath.Join(snaps))
		os.RemoveAll(filepath.Join(images))
	}

	// The honest artifact pulls, with this host's paths, and its clone
	// runs what ran in the source.
	pulled := name(t, "hpulled")
	mustKvbox(t, append(h2, "snapshots", "pull", "--insecure", honestRef, pulled)...)
	t.Cleanup(func() { kvbox(t, append(h2, "snapshots", "rm", pulled)...) })
	x, _ := os.ReadFile(filepath.Join(snaps, pulled, "domain.xml"))
	if bytes.Contains(x, []byte(srcState+"/")) {
		t.Errorf("the pulled domain XML names the pushing host's state dir:\n%s", x)
	}
	clone := name(t, "hclone")
	t.Cleanup(func() { kvbox(t, append(h2, "rm", "--force", clone)...) })
	mustKvbox(t, append(h2, "new", "--from", pulled, clone)...)
	if out := mustKvbox(t, append(h2, "exec", clone, "--", "sh", "-c", "cat /marker; ps | grep -c '[s]leep 77777'")...); out != "hostile-"+src+"\n1\n" {
		t.Errorf("the clone of the pulled snapshot: %q", out)
	}

	// A pulled snapshot names a box group: its clones join no group of
	// this host (the group's boxes are this host's to choose).
	p := readPushed(t, honestRef)
	p.edit("snapshot/domain.xml", "<transport>", "<group>"+runID+"web</group><transport>")
	gref := p.push(repo + ":group")
	gpulled, gclone := name(t, "hgpulled"), name(t, "hgclone")
	r := kvbox(t, append(h2, "snapshots", "pull", "--insecure", gref, gpulled)...)
	t.Cleanup(func() { kvbox(t, append(h2, "snapshots", "rm", gpulled)...) })
	if r.code != 0 || !strings.Contains(r.stderr, "join no group") {
		t.Errorf("pull of a snapshot of a group box: %s", r)
	}
	t.Cleanup(func() { kvbox(t, append(h2, "rm", "--force", gclone)...) })
	if r := kvbox(t, append(h2, "new", "--from", gpulled, gclone)...); r.code != 0 {
		t.Fatalf("clone of the pulled snapshot of a group box: %s", r)
	}
	for _, b := range listBoxes2(t, h2) {
		if b.Name == gclone && (b.Group != "" || b.Bridge != h2[3]) {
			t.Errorf("the clone of a pulled snapshot is in group %q on bridge %s, not on this host's %s", b.Group, b.Bridge, h2[3])
		}
	}
}
