package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/revert"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/statedir"
)

// installer puts a pulled artifact's cached blobs in place: the base image
// into images/ (unless this host has that version already), the snapshot
// into snapshots/. It checks everything first (prepare), writes into hidden
// folders, and renames them into place only once everything in them is
// checked: a refused artifact leaves nothing behind. Every file kvbox reads
// the artifact's paths from (snapshot.json, image.json, domain.xml) is
// written by kvbox from checked values, with this host's paths.
type installer struct {
	c        cache
	st       snapshot.Store
	stateDir string
	name     string // the snapshot's name here
	o        Options
	p        *plan

	imgTop, dstImageDir string // the image and its version folder here
	reuse               bool   // this host has that version already
	snap                snapshot.Snapshot
	img                 *image.Image // nil: the artifact has no image.json
	domXML              string       // the snapshot's domain XML, for this host
}

// metaParts are the parts prepare reads before anything is written.
var metaParts = []string{"snapshot/" + snapshot.MetaFile, "snapshot/" + snapshot.DomainXMLFile, "image-meta/image.json"}

// install checks and installs the cached blobs of m as the snapshot name
// and reports whether the base image was on this host already.
func install(ctx context.Context, c cache, st snapshot.Store, stateDir, name string, m *v1.Manifest, o Options) (snapshot.Snapshot, bool, error) {
	p, err := checkManifest(m)
	if err != nil {
		return snapshot.Snapshot{}, false, err
	}
	if err := o.checkPartCaps(p); err != nil {
		return snapshot.Snapshot{}, false, err
	}
	in, err := prepare(c, st, stateDir, name, p, o)
	if err != nil {
		return snapshot.Snapshot{}, false, err
	}
	if err := in.checkSpace(0); err != nil {
		return snapshot.Snapshot{}, false, err
	}
	s, err := in.install(ctx)
	return s, in.reuse, err
}

// prepare reads and checks the artifact's metadata parts (cached): its
// snapshot.json, image.json and domain XML, and every part's declared
// size against what they say.
func prepare(c cache, st snapshot.Store, stateDir, name string, p *plan, o Options) (*installer, error) {
	in := &installer{c: c, st: st, stateDir: stateDir, name: name, o: o, p: p}
	in.imgTop = filepath.Join(statedir.Layout{Root: stateDir}.Images(), p.imgName)
	in.dstImageDir = filepath.Join(in.imgTop, p.version)
	if _, err := os.Stat(in.dstImageDir); err == nil {
		in.reuse = true
		for _, t := range p.titles {
			if kind, f, _ := strings.Cut(t, "/"); kind == "image" {
				if fi, err := os.Stat(filepath.Join(in.dstImageDir, f)); err != nil || fi.Size() != p.parts[t].apparent {
					return nil, base.Errorf(base.Invalid, "image %s version %s exists on this host but differs from the pushed one (%s)", p.imgName, p.version, f)
				}
			}
		}
	}
	b, err := in.readSmall("snapshot/" + snapshot.MetaFile)
	if err != nil {
		return nil, err
	}
	if in.snap, err = checkSnapshotMeta(b, p, name, filepath.Join(st.Dir, name), in.dstImageDir); err != nil {
		return nil, err
	}
	if err := o.checkSizeCaps(in.snap); err != nil {
		return nil, err
	}
	if p.has("image-meta/image.json") {
		b, err := in.readSmall("image-meta/image.json")
		if err != nil {
			return nil, err
		}
		im, err := checkImageMeta(b, p, in.snap, in.dstImageDir)
		if err != nil {
			return nil, err
		}
		in.img = &im
	}
	if err := checkSizes(p, in.snap); err != nil {
		return nil, err
	}
	x, err := in.readSmall("snapshot/" + snapshot.DomainXMLFile)
	if err != nil {
		return nil, err
	}
	spec := snapshot.PulledSpec{
		Dir: in.snap.Dir, Image: p.imgName, DiskBytes: in.snap.DiskBytes, MemoryBytes: in.snap.MemoryBytes, CPUs: in.snap.CPUs,
		SrcKernel: p.srcImageDir + "/vmlinuz", SrcInitrd: p.srcImageDir + "/initrd.img",
		Emulator: o.Emulator, SrcWrapper: filepath.Join(p.srcState, "libexec", "qemu-system-x86_64"), Compat: p.compat,
	}
	if in.hasImageFile("vmlinuz") {
		spec.Kernel = filepath.Join(in.dstImageDir, "vmlinuz")
	}
	if in.hasImageFile("initrd.img") {
		spec.Initrd = filepath.Join(in.dstImageDir, "initrd.img")
	}
	var notes []string
	if in.domXML, notes, err = snapshot.PulledXML(string(x), spec); err != nil {
		return nil, err
	}
	for _, n := range notes {
		o.logf("  note: %s", n)
	}
	return in, nil
}

// hasImageFile: the image version will have file, pulled or already here.
func (in *installer) hasImageFile(file string) bool {
	if in.reuse {
		_, err := os.Stat(filepath.Join(in.dstImageDir, file))
		return err == nil
	}
	return in.p.has("image/" + file)
}

// readSmall decodes a cached metadata part into memory.
func (in *installer) readSmall(title string) ([]byte, error) {
	pt := in.p.parts[title]
	f, err := os.Open(in.c.blob(pt.desc.Digest))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := decodeSmall(f, pt.apparent, pt.data)
	if err != nil {
		return nil, fmt.Errorf("artifact part %s: %w", title, err)
	}
	return b, nil
}

// toWrite are the parts install decodes into files.
func (in *installer) toWrite() []part {
	var out []part
	for _, t := range in.p.titles {
		kind, f, _ := strings.Cut(t, "/")
		switch {
		case kind == "image" && !in.reuse:
		case kind == "snapshot" && f != snapshot.MetaFile && f != snapshot.DomainXMLFile && f != snapshot.CompatFile:
		default:
			continue
		}
		out = append(out, in.p.parts[t])
	}
	return out
}

// checkSpace refuses the pull unless the state dir's filesystem has room
// for the files it writes and the blobs still to be fetched.
func (in *installer) checkSpace(toFetch int64) error {
	need := toFetch
	for _, pt := range in.toWrite() {
		need += pt.data
	}
	return checkSpace(in.stateDir, need)
}

// decode writes one part into dir.
func (in *installer) decode(ctx context.Context, dir string, pt part) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	f, err := os.Open(in.c.blob(pt.desc.Digest))
	if err != nil {
		return err
	}
	defer f.Close()
	_, file, _ := strings.Cut(pt.title, "/")
	if err := decodeSparse(f, filepath.Join(dir, file), pt.apparent, pt.data); err != nil {
		return fmt.Errorf("artifact part %s: %w", pt.title, err)
	}
	return nil
}

// install writes the checked artifact and renames it into place.
func (in *installer) install(ctx context.Context) (snapshot.Snapshot, error) {
	r := revert.New()
	defer r.Fail()
	var imgTmp string
	if !in.reuse {
		if _, err := os.Stat(in.imgTop); errors.Is(err, os.ErrNotExist) {
			if err := os.MkdirAll(in.imgTop, 0o750); err != nil {
				return snapshot.Snapshot{}, err
			}
			r.Add(func() { os.Remove(in.imgTop) }) // only if nothing else came to be in it
		}
		var err error
		if imgTmp, err = os.MkdirTemp(in.imgTop, "."+in.p.version+".pulling-"); err != nil {
			return snapshot.Snapshot{}, err
		}
		// MkdirTemp's 0700, but the setgid bit it inherited kept: the
		// files in it are QEMU's group's, as in a folder made with Mkdir.
		if fi, err := os.Stat(imgTmp); err == nil {
			os.Chmod(imgTmp, 0o750|fi.Mode()&os.ModeSetgid)
		}
		defer os.RemoveAll(imgTmp)
		if err := in.writeImage(ctx, imgTmp); err != nil {
			return snapshot.Snapshot{}, err
		}
	}
	if err := os.MkdirAll(in.st.Dir, 0o750); err != nil {
		return snapshot.Snapshot{}, err
	}
	tmp := filepath.Join(in.st.Dir, "."+in.name+".pulling")
	os.RemoveAll(tmp)
	if err := os.Mkdir(tmp, 0o750); err != nil {
		return snapshot.Snapshot{}, err
	}
	defer os.RemoveAll(tmp)
	if err := in.writeSnapshot(ctx, tmp); err != nil {
		return snapshot.Snapshot{}, err
	}
	if err := ctx.Err(); err != nil {
		return snapshot.Snapshot{}, err
	}
	// Everything is checked and written: into place.
	if !in.reuse {
		if err := os.Rename(imgTmp, in.dstImageDir); err != nil {
			return snapshot.Snapshot{}, err
		}
		r.Add(func() { os.RemoveAll(in.dstImageDir) })
	}
	if meta := filepath.Join(in.imgTop, "image.json"); in.img != nil {
		if _, err := os.Stat(meta); errors.Is(err, os.ErrNotExist) {
			b, _ := json.MarshalIndent(in.img, "", "  ")
			if err := overlay.WriteFileAtomic(meta, append(b, '\n'), 0o640); err != nil {
				return snapshot.Snapshot{}, err
			}
			r.Add(func() { os.Remove(meta) })
		}
	}
	if err := os.Rename(tmp, in.snap.Dir); err != nil {
		return snapshot.Snapshot{}, err
	}
	r.Success()
	overlay.SyncDir(in.st.Dir)
	return in.st.Get(in.name)
}

// writeImage writes the image version's files into dir and checks their
// headers: a base image stands alone.
func (in *installer) writeImage(ctx context.Context, dir string) error {
	for _, pt := range in.toWrite() {
		if kind, _, _ := strings.Cut(pt.title, "/"); kind != "image" {
			continue
		}
		if err := in.decode(ctx, dir, pt); err != nil {
			return err
		}
	}
	disk := filepath.Join(dir, in.p.imageDisk)
	virtual := in.p.parts["image/"+in.p.imageDisk].apparent // raw
	if in.p.imageDisk == "disk.qcow2" {
		h, err := checkQCOW2(disk, "image/disk.qcow2", "", "")
		if err != nil {
			return err
		}
		virtual = int64(h.VirtualSize)
	}
	if virtual > in.snap.DiskBytes || in.img != nil && virtual != in.img.VirtualSize {
		return refused("artifact part image/%s is a disk of %d bytes, not the %d image.json says (at most the snapshot's %d)", in.p.imageDisk, virtual, in.imgVirtual(), in.snap.DiskBytes)
	}
	for _, f := range []string{in.p.imageDisk, "vmlinuz", "initrd.img"} {
		os.Chmod(filepath.Join(dir, f), 0o440) // base images are immutable, as image import leaves them
	}
	return syncDir(dir)
}

func (in *installer) imgVirtual() int64 {
	if in.img == nil {
		return 0
	}
	return in.img.VirtualSize
}

// writeSnapshot writes the snapshot's files into dir: the parts, their
// disk checked and pointed at this host's base image, and the files kvbox
// writes itself from what it checked. Sealed as a made snapshot is.
func (in *installer) writeSnapshot(ctx context.Context, dir string) error {
	for _, pt := range in.toWrite() {
		if kind, _, _ := strings.Cut(pt.title, "/"); kind != "snapshot" {
			continue
		}
		if err := in.decode(ctx, dir, pt); err != nil {
			return err
		}
	}
	if fi, err := os.Stat(filepath.Join(dir, domain.AgentTokenFile)); err != nil || fi.Size() != agent.TokenSize {
		return refused("artifact part snapshot/%s is not a token of %d bytes", domain.AgentTokenFile, agent.TokenSize)
	}
	disk := filepath.Join(dir, snapshot.DiskFile)
	format := strings.TrimPrefix(in.p.imageDisk, "disk.")
	h, err := checkQCOW2(disk, "snapshot/"+snapshot.DiskFile, in.p.srcImageDir+"/"+in.p.imageDisk, format)
	if err != nil {
		return err
	}
	if int64(h.VirtualSize) != in.snap.DiskBytes {
		return refused("artifact part snapshot/%s has a virtual size of %d bytes, its snapshot.json says %d", snapshot.DiskFile, h.VirtualSize, in.snap.DiskBytes)
	}
	// Its backing file names the pushing host's path: point it here (-u:
	// the base is the same bytes, only its name changes; the header was
	// checked, so qemu-img opens nothing but this file).
	if out, err := exec.CommandContext(ctx, "qemu-img", "rebase", "-u", "-f", "qcow2", "-F", format, "-b", in.snap.BaseDisk, disk).CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img rebase: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.WriteFile(filepath.Join(dir, snapshot.DomainXMLFile), []byte(in.domXML), 0o640); err != nil {
		return err
	}
	mb, err := json.MarshalIndent(in.snap, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, snapshot.MetaFile), mb, 0o640); err != nil {
		return err
	}
	cb, err := json.Marshal(in.p.compat)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, snapshot.CompatFile), cb, 0o640); err != nil {
		return err
	}
	if err := syncDir(dir); err != nil {
		return err
	}
	// As a made snapshot is sealed: read-only, QEMU's group (snapshots/ is setgid), nothing for others.
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		mode := os.FileMode(0o440)
		if e.Name() == domain.AgentTokenFile {
			mode = 0o400 // the token of the agent in the memory: root's only
		}
		if err := os.Chmod(filepath.Join(dir, e.Name()), mode); err != nil {
			return err
		}
	}
	return nil
}

// checkQCOW2 checks the header of a pulled qcow2 image: no external data
// file, no encryption, no feature QEMU would need to repair, and a backing
// file only where one is expected (backing, of format backingFmt), none
// otherwise.
func checkQCOW2(path, title, backing, backingFmt string) (overlay.QCOW2Header, error) {
	f, err := os.Open(path)
	if err != nil {
		return overlay.QCOW2Header{}, err
	}
	defer f.Close()
	h, err := overlay.ReadQCOW2Header(f)
	switch {
	case err != nil:
		return h, refused("artifact part %s: %v", title, err)
	case h.HasDataFile || h.DataFile != "" || h.AutoclearFeatures&overlay.QCOW2AutoclearRawData != 0:
		return h, refused("artifact part %s keeps its data in the external data file %q (a host file)", title, printable(h.DataFile))
	case h.CryptMethod != 0 || h.Encrypted:
		return h, refused("artifact part %s is encrypted", title)
	case h.IncompatibleFeatures&^(overlay.QCOW2IncompatCompression|overlay.QCOW2IncompatExtendedL2) != 0:
		return h, refused("artifact part %s has qcow2 incompatible features %#x (dirty, corrupt or unknown)", title, h.IncompatibleFeatures)
	case h.Snapshots != 0:
		return h, refused("artifact part %s holds %d internal snapshots (kvbox makes none)", title, h.Snapshots)
	case h.BackingFile != backing:
		if h.BackingFile == "" {
			return h, refused("artifact part %s has no backing file, kvbox's stands on %s", title, backing)
		}
		return h, refused("artifact part %s names the backing file %q (a disk in the artifact stands on its base image only)", title, printable(h.BackingFile))
	case backing != "" && h.BackingFormat != "" && h.BackingFormat != backingFmt:
		return h, refused("artifact part %s names the backing format %q, not %s", title, printable(h.BackingFormat), backingFmt)
	case h.VirtualSize > maxDiskBytes:
		return h, refused("artifact part %s has a virtual size of %d bytes", title, h.VirtualSize)
	}
	return h, nil
}
