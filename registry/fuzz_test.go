package registry

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"kvbox.dev/kvbox/snapshot"
)

// The fuzz targets of the pull installer's inputs: the manifest,
// snapshot.json and image.json (the domain XML's is snapshot's
// FuzzPulledXML). Each checks that what the installer accepts keeps to its
// rules, whatever the bytes.

// honestManifest is the manifest of a push of a snapshot of a tiny box
// (blob digests made up: the checks read sizes and titles).
func honestManifest() *v1.Manifest {
	m := &v1.Manifest{SchemaVersion: 2, MediaType: "application/vnd.oci.image.manifest.v1+json",
		Annotations: map[string]string{AnnotKind: ArtifactType, AnnotSnapshot: "s1", AnnotStateDir: srcState,
			AnnotImageDir: srcImageDir, AnnotImageName: "tiny", AnnotCompat: srcCompat}}
	for i, p := range []struct {
		title          string
		apparent, data int64
		blob           int64
	}{
		{"snapshot/agent.token", 32, 32, 70}, {"snapshot/compat.json", 5628, 5628, 1800}, {"snapshot/disk.qcow2", 589824, 589824, 40000},
		{"snapshot/domain.xml", 6572, 6572, 1600}, {"snapshot/snapshot.json", 601, 601, 400}, {"snapshot/state", stateSize, 76 << 20, 30 << 20},
		{"image/disk.qcow2", 42 << 20, 42 << 20, 15 << 20}, {"image/initrd.img", 9 << 20, 9 << 20, 9 << 20}, {"image/vmlinuz", 8 << 20, 8 << 20, 8 << 20},
		{"image-meta/image.json", 492, 492, 300},
	} {
		m.Layers = append(m.Layers, v1.Descriptor{MediaType: PartType, Size: p.blob,
			Digest:      v1.Hash{Algorithm: "sha256", Hex: strings.Repeat("0", 63) + string(rune('a'+i))},
			Annotations: map[string]string{AnnotTitle: p.title, AnnotApparent: itoa(p.apparent), AnnotDataBytes: itoa(p.data)}})
	}
	return m
}

func itoa(n int64) string { b, _ := json.Marshal(n); return string(b) }

// FuzzManifest: a manifest checkManifest accepts names only files kvbox
// knows, once each, with the ones it needs, sizes within their limits.
func FuzzManifest(f *testing.F) {
	b, _ := json.Marshal(honestManifest())
	f.Add(b)
	f.Add([]byte(strings.Replace(string(b), "snapshot/agent.token", "snapshot/../x", 1)))
	f.Add([]byte(strings.Replace(string(b), `"dev.kvbox.image":"tiny"`, `"dev.kvbox.image":"../x"`, 1)))
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := v1.ParseManifest(strings.NewReader(string(in)))
		if err != nil {
			return
		}
		p, err := checkManifest(m)
		if err != nil {
			return
		}
		if strings.ContainsAny(p.imgName, "/\x00") || p.imgName == ".." || strings.HasPrefix(p.version, ".") || strings.Contains(p.version, "/") {
			t.Fatalf("accepted image %q version %q", p.imgName, p.version)
		}
		for _, need := range []string{"snapshot/snapshot.json", "snapshot/domain.xml", "snapshot/disk.qcow2", "snapshot/state", "image/" + p.imageDisk} {
			if !p.has(need) {
				t.Fatalf("accepted a manifest without %s", need)
			}
		}
		for _, title := range p.titles {
			pt := p.parts[title]
			kind, file, _ := strings.Cut(title, "/")
			if !artifactFiles[kind][file] || filepath.Base(file) != file {
				t.Fatalf("accepted the part %q", title)
			}
			if pt.apparent < 0 || pt.data < 0 || pt.data > pt.apparent || pt.apparent > hardLimit(title) || pt.desc.Size > blobLimit(pt) {
				t.Fatalf("accepted %s with sizes %d/%d, blob %d", title, pt.apparent, pt.data, pt.desc.Size)
			}
		}
	})
}

func honestPlan(t testing.TB) *plan {
	p, err := checkManifest(honestManifest())
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// FuzzSnapshotJSON: a snapshot.json checkSnapshotMeta accepts maps the
// snapshot's RAM from one of its own files, in its folder, stands on the
// pulled image version, and has sizes kvbox would make.
func FuzzSnapshotJSON(f *testing.F) {
	for _, s := range []string{
		`{"name":"s1","image":"tiny","base_disk":"` + srcImageDir + `/disk.qcow2","base_format":"qcow2","memory":{"file":"state","offset":1048576},"cpus":1,"memory_bytes":268435456,"disk_bytes":1073741824}`,
		`{"name":"s1","image":"tiny","base_disk":"` + srcImageDir + `/disk.qcow2","base_format":"qcow2","memory":{"file":"../x/state"},"cpus":1,"memory_bytes":268435456,"disk_bytes":1073741824}`,
	} {
		f.Add([]byte(s))
	}
	p := honestPlan(f)
	const dir, imgDir = "/var/lib/kvbox/snapshots/pulled", "/var/lib/kvbox/images/tiny/v-1"
	f.Fuzz(func(t *testing.T, in []byte) {
		s, err := checkSnapshotMeta(in, p, "pulled", dir, imgDir)
		if err != nil {
			return
		}
		mf := s.Memory.File
		if mf != snapshot.StateFile || !p.has("snapshot/"+mf) || s.Dir != dir || s.Name != "pulled" ||
			filepath.Dir(s.BaseDisk) != imgDir || s.Image != "tiny" || s.Bitmap != "" {
			t.Fatalf("accepted %+v", s)
		}
		if s.CPUs < 1 || s.CPUs > 256 || s.MemoryBytes < 64<<20 || s.MemoryBytes > maxMemoryBytes || s.DiskBytes > maxDiskBytes ||
			s.Memory.Offset < 0 || s.Memory.Offset+s.MemoryBytes > p.parts["snapshot/"+mf].apparent {
			t.Fatalf("accepted sizes %+v", s)
		}
	})
}

// FuzzImageJSON: an image.json checkImageMeta accepts names the pulled
// version's own files, in kvbox's formats.
func FuzzImageJSON(f *testing.F) {
	f.Add([]byte(`{"name":"tiny","disk":"` + srcImageDir + `/disk.qcow2","format":"qcow2","kernel":"` + srcImageDir + `/vmlinuz","initrd":"` + srcImageDir + `/initrd.img","cmdline":"console=ttyS0","virtual_size_bytes":536870912,"agent":"yes"}`))
	f.Add([]byte(`{"name":"tiny","disk":"/dev/sda","format":"host_device","virtual_size_bytes":536870912}`))
	p := honestPlan(f)
	const imgDir = "/var/lib/kvbox/images/tiny/v-1"
	s := snapshot.Snapshot{DiskBytes: 1 << 30}
	f.Fuzz(func(t *testing.T, in []byte) {
		im, err := checkImageMeta(in, p, s, imgDir)
		if err != nil {
			return
		}
		if im.Disk != imgDir+"/"+p.imageDisk || im.Format != strings.TrimPrefix(p.imageDisk, "disk.") || im.Name != "tiny" ||
			im.Kernel != "" && im.Kernel != imgDir+"/vmlinuz" || im.Initrd != "" && im.Initrd != imgDir+"/initrd.img" ||
			im.VirtualSize <= 0 || im.VirtualSize > s.DiskBytes || strings.ContainsAny(im.Cmdline, "\n\x00\x1b") {
			t.Fatalf("accepted %+v", im)
		}
	})
}

// The honest seed of FuzzSnapshotJSON is accepted: the fuzzer starts from
// what passes.
func TestFuzzSeedsAreHonest(t *testing.T) {
	p := honestPlan(t)
	if _, err := checkSnapshotMeta([]byte(`{"name":"s1","image":"tiny","base_disk":"`+srcImageDir+`/disk.qcow2","base_format":"qcow2","memory":{"file":"state","offset":1048576},"cpus":1,"memory_bytes":268435456,"disk_bytes":1073741824}`), p, "x", "/d", "/i"); err != nil {
		t.Error(err)
	}
}
