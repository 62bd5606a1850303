package registry

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/snapshot"
)

// A pulled artifact is untrusted input: whoever pushed it chose its
// manifest, every part's bytes and every size it declares. Before a byte
// of it is written, kvbox checks the manifest (the parts are files it
// knows, their declared sizes within what such a file may be and within
// the host's free space), snapshot.json and image.json (their files are
// the artifact's own, in its folders, in kvbox's formats; sizes within
// kvbox's limits), and builds the domain XML from its own template
// (snapshot.PulledXML). While writing, a part expands to exactly what it
// declared, and every image file's header is checked before it is used
// (image.go's qcow2 checks).

// Limits on what a pulled artifact may declare.
const (
	maxParts       = 32
	maxMetaBytes   = 1 << 20 // snapshot.json, domain.xml, image.json, compat.json
	maxKernelBytes = 1 << 30 // vmlinuz, initrd.img
	maxMemoryBytes = 1 << 40 // a box's RAM
	maxDiskBytes   = 64 << 40
	// stateSlack is what a state file may hold besides the RAM: the
	// device state, firmware and option ROMs, mapped-ram's bitmaps.
	stateSlack = 512 << 20
	// spaceReserve is left free on the state dir's filesystem by a pull:
	// boxes write their disks there.
	spaceReserve = 256 << 20
)

// The files an artifact may carry, by kind (a part's title is KIND/FILE).
var artifactFiles = map[string]map[string]bool{
	"snapshot": {snapshot.MetaFile: true, snapshot.DomainXMLFile: true, snapshot.StateFile: true,
		snapshot.DiskFile: true, domain.AgentTokenFile: true, snapshot.CompatFile: true},
	"image":      {"disk.qcow2": true, "disk.raw": true, "vmlinuz": true, "initrd.img": true},
	"image-meta": {"image.json": true},
}

var versionRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// refused is one line saying what of an artifact kvbox refuses.
func refused(format string, a ...any) error {
	return base.Errorf(base.Invalid, format, a...)
}

// part is one checked layer of an artifact.
type part struct {
	desc           v1.Descriptor
	title          string
	apparent, data int64 // as declared: the file's size, and its bytes outside holes
}

// plan is what checkManifest read from a manifest.
type plan struct {
	srcState, srcImageDir, imgName, version string
	compat                                  snapshot.Compat
	parts                                   map[string]part // by title
	titles                                  []string        // in the manifest's order
	imageDisk                               string          // disk.qcow2 or disk.raw
}

func (p *plan) has(title string) bool { _, ok := p.parts[title]; return ok }

// checkManifest checks a manifest before anything of it is fetched.
func checkManifest(m *v1.Manifest) (*plan, error) {
	if m == nil {
		return nil, refused("no manifest")
	}
	a := m.Annotations
	p := &plan{srcState: a[AnnotStateDir], srcImageDir: a[AnnotImageDir], imgName: a[AnnotImageName], parts: map[string]part{}}
	if err := base.ValidName(p.imgName); err != nil {
		return nil, refused("the artifact names the image %q: %v", printable(p.imgName), err)
	}
	for _, d := range []struct{ what, path string }{{"state dir", p.srcState}, {"image folder", p.srcImageDir}} {
		if !filepath.IsAbs(d.path) || filepath.Clean(d.path) != d.path || len(d.path) > 1024 || printable(d.path) != d.path {
			return nil, refused("the artifact names the pushing host's %s %q (an absolute, clean path)", d.what, printable(d.path))
		}
	}
	p.version = filepath.Base(p.srcImageDir)
	if !versionRE.MatchString(p.version) {
		return nil, refused("the artifact names the image folder %q", printable(p.srcImageDir))
	}
	if err := json.Unmarshal([]byte(a[AnnotCompat]), &p.compat); err != nil {
		return nil, refused("the artifact's %s annotation: %v", AnnotCompat, err)
	}
	if len(m.Layers) > maxParts {
		return nil, refused("the artifact has %d parts (at most %d)", len(m.Layers), maxParts)
	}
	for _, l := range m.Layers {
		title := l.Annotations[AnnotTitle]
		kind, file, _ := strings.Cut(title, "/")
		if !artifactFiles[kind][file] {
			return nil, refused("the artifact has a part %q that is not a file kvbox knows", printable(title))
		}
		if p.has(title) {
			return nil, refused("the artifact has the part %s twice", title)
		}
		pt := part{desc: l, title: title}
		var err1, err2 error
		pt.apparent, err1 = strconv.ParseInt(l.Annotations[AnnotApparent], 10, 64)
		pt.data, err2 = strconv.ParseInt(l.Annotations[AnnotDataBytes], 10, 64)
		if err1 != nil || err2 != nil || pt.apparent < 0 || pt.data < 0 || pt.data > pt.apparent {
			return nil, refused("artifact part %s declares no sizes kvbox can read (%s, %s)", title, AnnotApparent, AnnotDataBytes)
		}
		if max := hardLimit(title); pt.apparent > max {
			return nil, refused("artifact part %s says it is %d bytes, more than such a file may be (%d)", title, pt.apparent, max)
		}
		if l.Size <= 0 || l.Size > blobLimit(pt) {
			return nil, refused("artifact part %s is a blob of %d bytes for %d bytes of data", title, l.Size, pt.data)
		}
		p.parts[title] = pt
		p.titles = append(p.titles, title)
	}
	// The agent token is the snapshot's own, which its clones' first
	// contact presents: a snapshot without one could never be cloned.
	for _, f := range []string{snapshot.MetaFile, snapshot.DomainXMLFile, snapshot.DiskFile, snapshot.StateFile, domain.AgentTokenFile} {
		if !p.has("snapshot/" + f) {
			return nil, refused("the artifact has no snapshot/%s", f)
		}
	}
	switch q, r := p.has("image/disk.qcow2"), p.has("image/disk.raw"); {
	case q && r:
		return nil, refused("the artifact has two base image disks")
	case q:
		p.imageDisk = "disk.qcow2"
	case r:
		p.imageDisk = "disk.raw"
	default:
		return nil, refused("the artifact has no base image disk")
	}
	return p, nil
}

// hardLimit is the most bytes a part may declare whatever its snapshot
// says.
func hardLimit(title string) int64 {
	switch title {
	case "snapshot/" + domain.AgentTokenFile:
		return agent.TokenSize
	case "image/vmlinuz", "image/initrd.img":
		return maxKernelBytes
	case "snapshot/" + snapshot.StateFile:
		return maxMemoryBytes + stateSlack
	case "snapshot/" + snapshot.DiskFile, "image/disk.qcow2", "image/disk.raw":
		return diskFileLimit(maxDiskBytes)
	}
	return maxMetaBytes
}

// diskFileLimit is the most a qcow2 or raw file of a disk of size bytes
// takes: the data and qcow2's tables.
func diskFileLimit(size int64) int64 { return size + size/8 + 64<<20 }

// blobLimit is the most bytes a blob may take to encode a part: the
// extent map (16 bytes an extent, an extent at least 512 bytes of data
// and one of hole), the data, and zstd's framing.
func blobLimit(p part) int64 { return 64 + 16*(p.apparent/512+1) + p.data + p.data/64 + 1<<20 }

// checkSnapshotMeta checks a pulled snapshot.json and returns the
// snapshot as it is installed here: named name, in dir, its disk on the
// image version in dstImageDir; fields that only meant something on the
// pushing host (its disk's dirty bitmap) are not carried.
func checkSnapshotMeta(b []byte, p *plan, name, dir, dstImageDir string) (snapshot.Snapshot, error) {
	var s snapshot.Snapshot
	if err := json.Unmarshal(b, &s); err != nil {
		return s, refused("the artifact's snapshot.json: %v", err)
	}
	if s.Image != p.imgName {
		return s, refused("snapshot.json names the image %q, the artifact %q", printable(s.Image), p.imgName)
	}
	format := strings.TrimPrefix(p.imageDisk, "disk.")
	if s.BaseFormat != format || s.BaseDisk != p.srcImageDir+"/"+p.imageDisk {
		return s, refused("snapshot.json names the base disk %q (%s), not the artifact's %s", printable(s.BaseDisk), printable(s.BaseFormat), p.srcImageDir+"/"+p.imageDisk)
	}
	switch {
	case s.CPUs < 1 || s.CPUs > 256:
		return s, refused("snapshot.json says %d vCPUs (1 to 256)", s.CPUs)
	case s.MemoryBytes < 64<<20 || s.MemoryBytes > maxMemoryBytes || s.MemoryBytes%(2<<20) != 0:
		return s, refused("snapshot.json says %d bytes of RAM (64 MB to 1 TiB, a multiple of 2 MB)", s.MemoryBytes)
	case s.DiskBytes < 1<<20 || s.DiskBytes > maxDiskBytes || s.DiskBytes%512 != 0:
		return s, refused("snapshot.json says a disk of %d bytes (1 MiB to 64 TiB, a multiple of 512)", s.DiskBytes)
	}
	mp, ok := p.parts["snapshot/"+snapshot.StateFile]
	if s.Memory.File != snapshot.StateFile || !ok {
		return s, refused("snapshot.json names the memory file %q (state, a file of the artifact)", printable(s.Memory.File))
	}
	if s.Memory.Offset < 0 || s.Memory.Offset%4096 != 0 || s.Memory.Offset > stateSlack || s.Memory.Offset+s.MemoryBytes > mp.apparent {
		return s, refused("snapshot.json maps the RAM at %d in %s, which is %d bytes", s.Memory.Offset, snapshot.StateFile, mp.apparent)
	}
	if !uuidish(s.GuestBootID) {
		s.GuestBootID = ""
	}
	out := snapshot.Snapshot{
		Name: name, Box: s.Box, BoxUUID: s.BoxUUID, Created: s.Created, Image: p.imgName,
		BaseDisk: filepath.Join(dstImageDir, p.imageDisk), BaseFormat: format, Parent: s.Parent, GuestBootID: s.GuestBootID,
		Memory: snapshot.Memory{File: s.Memory.File, Offset: s.Memory.Offset},
		CPUs:   s.CPUs, MemoryBytes: s.MemoryBytes, DiskBytes: s.DiskBytes,
		Incremental: s.Incremental, DiskCopiedBytes: s.DiskCopiedBytes, PauseMillis: s.PauseMillis, Expires: s.Expires,
		Dir: dir,
	}
	for _, f := range []*string{&out.Box, &out.BoxUUID, &out.Parent} {
		if len(*f) > 256 {
			*f = (*f)[:256]
		}
	}
	return out, nil
}

// uuidish: a boot id as the guest kernel writes it.
func uuidish(s string) bool {
	return len(s) <= 64 && strings.Trim(s, "0123456789abcdefABCDEF-") == ""
}

// checkImageMeta checks a pulled image.json and returns the image as it
// is registered here, its files in dstImageDir.
func checkImageMeta(b []byte, p *plan, s snapshot.Snapshot, dstImageDir string) (image.Image, error) {
	var im image.Image
	if err := json.Unmarshal(b, &im); err != nil {
		return im, refused("the artifact's image.json: %v", err)
	}
	format := strings.TrimPrefix(p.imageDisk, "disk.")
	if im.Format != format || im.Disk != p.srcImageDir+"/"+p.imageDisk {
		return im, refused("image.json names the disk %q (%s), not the artifact's %s", printable(im.Disk), printable(im.Format), p.srcImageDir+"/"+p.imageDisk)
	}
	out := image.Image{Name: p.imgName, Disk: filepath.Join(dstImageDir, p.imageDisk), Format: format, Agent: im.Agent, Created: im.Created}
	for _, f := range []struct {
		file     string
		got, dst *string
	}{{"vmlinuz", &im.Kernel, &out.Kernel}, {"initrd.img", &im.Initrd, &out.Initrd}} {
		if *f.got == "" {
			continue
		}
		if *f.got != p.srcImageDir+"/"+f.file || !p.has("image/"+f.file) {
			return im, refused("image.json names the file %q, not one of the artifact's", printable(*f.got))
		}
		*f.dst = filepath.Join(dstImageDir, f.file)
	}
	if im.Initrd != "" && im.Kernel == "" {
		return im, refused("image.json names an initrd without a kernel")
	}
	if len(im.Cmdline) > 4096 || strings.IndexFunc(im.Cmdline, func(r rune) bool { return r < 0x20 || r == 0x7f }) >= 0 {
		return im, refused("image.json has a kernel command line longer than 4096 bytes or with control characters")
	}
	out.Cmdline = im.Cmdline
	switch im.Agent {
	case "yes", "no", "unknown":
	default:
		out.Agent = "unknown"
	}
	if im.VirtualSize <= 0 || im.VirtualSize > s.DiskBytes {
		return im, refused("image.json says a disk of %d bytes, more than the snapshot's %d", im.VirtualSize, s.DiskBytes)
	}
	out.VirtualSize = im.VirtualSize
	if out.Created.IsZero() {
		out.Created = time.Now().UTC()
	}
	return out, nil
}

// checkPartCaps refuses, from the manifest alone (before any part is
// fetched), an artifact whose memory or disk parts declare more than the
// caps of o allow a snapshot of.
func (o Options) checkPartCaps(p *plan) error {
	limits := map[string]int64{}
	if o.MaxMemoryBytes > 0 {
		limits["snapshot/"+snapshot.StateFile] = o.MaxMemoryBytes + stateSlack
	}
	if o.MaxDiskBytes > 0 {
		for _, t := range []string{"snapshot/" + snapshot.DiskFile, "image/disk.qcow2"} {
			limits[t] = diskFileLimit(o.MaxDiskBytes)
		}
		limits["image/disk.raw"] = o.MaxDiskBytes
	}
	for _, t := range p.titles {
		if max, ok := limits[t]; ok && p.parts[t].apparent > max {
			return refused("artifact part %s says it is %s, more than this host takes of a snapshot (%s)", t, human(p.parts[t].apparent), human(max))
		}
	}
	return nil
}

// checkSizeCaps refuses a snapshot (its snapshot.json, read before its
// memory and disk parts are fetched) larger than the caps of o.
func (o Options) checkSizeCaps(s snapshot.Snapshot) error {
	switch {
	case o.MaxCPUs > 0 && s.CPUs > o.MaxCPUs:
		return refused("the snapshot has %d vCPUs, more than the %d this host takes", s.CPUs, o.MaxCPUs)
	case o.MaxMemoryBytes > 0 && s.MemoryBytes > o.MaxMemoryBytes:
		return refused("the snapshot has %s of RAM, more than the %s this host takes", human(s.MemoryBytes), human(o.MaxMemoryBytes))
	case o.MaxDiskBytes > 0 && s.DiskBytes > o.MaxDiskBytes:
		return refused("the snapshot has a disk of %s, more than the %s this host takes", human(s.DiskBytes), human(o.MaxDiskBytes))
	}
	return nil
}

// checkSizes checks each part's declared size against what its snapshot
// says it may be.
func checkSizes(p *plan, s snapshot.Snapshot) error {
	limits := map[string]int64{
		"snapshot/" + snapshot.StateFile: s.MemoryBytes + stateSlack,
		"snapshot/" + snapshot.DiskFile:  diskFileLimit(s.DiskBytes),
		"image/disk.qcow2":               diskFileLimit(s.DiskBytes),
		"image/disk.raw":                 s.DiskBytes,
	}
	for _, t := range p.titles {
		if max, ok := limits[t]; ok && p.parts[t].apparent > max {
			return refused("artifact part %s says it is %d bytes, more than its snapshot's sizes allow (%d)", t, p.parts[t].apparent, max)
		}
	}
	return nil
}

// checkSpace refuses a pull whose parts need more than dir's filesystem
// has free, less spaceReserve: need is what the pull will write.
func checkSpace(dir string, need int64) error {
	free, err := FreeSpace(dir)
	if err != nil {
		return err
	}
	if need > free-spaceReserve {
		return refused("the snapshot needs %s on disk, %s has %s free (kvbox keeps %s free)",
			human(need), dir, human(free), human(spaceReserve))
	}
	return nil
}

// FreeSpace is what dir's filesystem has free for root's files.
func FreeSpace(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("free space of %s: %w", dir, err)
	}
	return int64(st.Bavail) * int64(st.Bsize), nil
}

// printable is s with every byte that is not printable ASCII escaped and
// cut to fit a line: it goes into a message.
func printable(s string) string {
	if len(s) > 120 {
		s = s[:120] + "..."
	}
	q := strconv.QuoteToASCII(s)
	return q[1 : len(q)-1]
}
