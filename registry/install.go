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

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
)

// installer puts a pulled artifact's cached blobs in place: the base image
// into images/ (unless this host has that version already), the snapshot
// into a hidden folder renamed into place once complete, with every path
// that named the source host's state directory rewritten to this one.
type installer struct {
	c        cache
	st       snapshot.Store
	stateDir string
	name     string // the snapshot's name here
	m        *v1.Manifest

	srcState, srcImageDir, imgName string // as the pushing host had them
	imgTop, dstImageDir            string // the image and its version folder here
	parts                          map[string][]v1.Descriptor
}

// install decodes the cached blobs of m into the snapshot name and reports
// whether the base image was on this host already.
func install(ctx context.Context, c cache, st snapshot.Store, stateDir, name string, m *v1.Manifest) (snapshot.Snapshot, bool, error) {
	in := &installer{c: c, st: st, stateDir: stateDir, name: name, m: m}
	if err := in.check(); err != nil {
		return snapshot.Snapshot{}, false, err
	}
	reused, err := in.image(ctx)
	if err != nil {
		return snapshot.Snapshot{}, false, err
	}
	if err := in.imageMeta(ctx); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	s, err := in.snapshot(ctx)
	return s, reused, err
}

// check reads the manifest's names and sorts its parts by kind, refusing
// any name that could reach outside the folders they go to.
func (in *installer) check() error {
	a := in.m.Annotations
	in.srcState, in.srcImageDir, in.imgName = a[AnnotStateDir], a[AnnotImageDir], a[AnnotImageName]
	if err := domain.ValidName(in.imgName); err != nil {
		return fmt.Errorf("artifact names a bad image: %w", err)
	}
	version := filepath.Base(in.srcImageDir)
	if version == "." || version == "/" || strings.HasPrefix(version, ".") {
		return fmt.Errorf("artifact names a bad image folder %q", in.srcImageDir)
	}
	in.imgTop = filepath.Join(in.stateDir, "images", in.imgName)
	in.dstImageDir = filepath.Join(in.imgTop, version)
	in.parts = map[string][]v1.Descriptor{}
	for _, l := range in.m.Layers {
		kind, file, ok := strings.Cut(l.Annotations[AnnotTitle], "/")
		if !ok || file == "" || strings.ContainsAny(file, "/\x00") || file[0] == '.' {
			return fmt.Errorf("artifact part with a bad title %q", l.Annotations[AnnotTitle])
		}
		in.parts[kind] = append(in.parts[kind], l)
	}
	return nil
}

// title is the file name of a part.
func title(l v1.Descriptor) string { _, f, _ := strings.Cut(l.Annotations[AnnotTitle], "/"); return f }

// decodeAll writes every part of ls into dir.
func (in *installer) decodeAll(ctx context.Context, dir string, ls []v1.Descriptor) error {
	for _, l := range ls {
		if err := ctx.Err(); err != nil {
			return err
		}
		f, err := os.Open(in.c.blob(l.Digest))
		if err != nil {
			return err
		}
		err = decodeSparse(f, filepath.Join(dir, title(l)))
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", l.Annotations[AnnotTitle], err)
		}
	}
	return nil
}

// image installs the base image's version folder, or checks that the one
// this host has is the same, and reports which.
func (in *installer) image(ctx context.Context) (reused bool, err error) {
	if _, err := os.Stat(in.dstImageDir); err == nil {
		for _, l := range in.parts["image"] {
			if fi, err := os.Stat(filepath.Join(in.dstImageDir, title(l))); err != nil || fi.Size() != apparent(l) {
				return true, fmt.Errorf("image %s version %s exists on this host but differs from the pushed one (%s)", in.imgName, filepath.Base(in.dstImageDir), title(l))
			}
		}
		return true, nil
	}
	if err := os.MkdirAll(in.imgTop, 0o750); err != nil {
		return false, err
	}
	tmp := filepath.Join(in.imgTop, "."+filepath.Base(in.dstImageDir)+".pulling")
	os.RemoveAll(tmp)
	if err := os.Mkdir(tmp, 0o750); err != nil {
		return false, err
	}
	if err := in.decodeAll(ctx, tmp, in.parts["image"]); err != nil {
		os.RemoveAll(tmp)
		return false, err
	}
	for _, f := range []string{"disk.qcow2", "vmlinuz", "initrd.img"} {
		os.Chmod(filepath.Join(tmp, f), 0o440) // base images are immutable, as image import leaves them
	}
	if err := os.Rename(tmp, in.dstImageDir); err != nil {
		os.RemoveAll(tmp)
		return false, err
	}
	return false, nil
}

// imageMeta installs the image's metadata when this host has none, with the
// paths of its version folder rewritten.
func (in *installer) imageMeta(ctx context.Context) error {
	if _, err := os.Stat(filepath.Join(in.imgTop, "image.json")); !errors.Is(err, os.ErrNotExist) || len(in.parts["image-meta"]) != 1 {
		return nil
	}
	tmp := filepath.Join(in.imgTop, ".image.json.pulling")
	os.Remove(tmp)
	tmpDir, err := os.MkdirTemp(in.imgTop, ".meta-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmpDir)
	if err := in.decodeAll(ctx, tmpDir, in.parts["image-meta"]); err != nil {
		return err
	}
	b, err := os.ReadFile(filepath.Join(tmpDir, "image.json"))
	if err != nil {
		return err
	}
	b = []byte(strings.ReplaceAll(string(b), in.srcImageDir+"/", in.dstImageDir+"/"))
	if err := os.WriteFile(tmp, b, 0o640); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(in.imgTop, "image.json"))
}

// rewrite points the source host's paths at this host's.
func (in *installer) rewrite(s string) string {
	s = strings.ReplaceAll(s, in.srcImageDir+"/", in.dstImageDir+"/")
	if in.srcState != "" && in.srcState != in.stateDir {
		s = strings.ReplaceAll(s, in.srcState+"/", in.stateDir+"/")
	}
	return s
}

// snapshot installs the snapshot folder: decoded into a hidden folder,
// its paths and disk's backing file pointed at this host, sealed, renamed
// into place.
func (in *installer) snapshot(ctx context.Context) (snapshot.Snapshot, error) {
	if err := os.MkdirAll(in.st.Dir, 0o750); err != nil {
		return snapshot.Snapshot{}, err
	}
	tmp := filepath.Join(in.st.Dir, "."+in.name+".pulling")
	os.RemoveAll(tmp)
	if err := os.Mkdir(tmp, 0o750); err != nil {
		return snapshot.Snapshot{}, err
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	if err := in.decodeAll(ctx, tmp, in.parts["snapshot"]); err != nil {
		return snapshot.Snapshot{}, err
	}
	xmlPath := filepath.Join(tmp, snapshot.DomainXMLFile)
	xb, err := os.ReadFile(xmlPath)
	if err != nil {
		return snapshot.Snapshot{}, fmt.Errorf("artifact has no %s: %w", snapshot.DomainXMLFile, err)
	}
	if err := os.WriteFile(xmlPath, []byte(in.rewrite(string(xb))), 0o640); err != nil {
		return snapshot.Snapshot{}, err
	}
	if err := in.rebaseMeta(ctx, tmp); err != nil {
		return snapshot.Snapshot{}, err
	}
	if err := os.WriteFile(filepath.Join(tmp, snapshot.CompatFile), []byte(in.m.Annotations[AnnotCompat]), 0o640); err != nil {
		return snapshot.Snapshot{}, err
	}
	if err := syncDir(tmp); err != nil {
		return snapshot.Snapshot{}, err
	}
	if err := ctx.Err(); err != nil {
		return snapshot.Snapshot{}, err
	}
	// As a made snapshot is sealed: read-only, QEMU's group (snapshots/ is setgid), nothing for others.
	ents, err := os.ReadDir(tmp)
	if err != nil {
		return snapshot.Snapshot{}, err
	}
	for _, e := range ents {
		mode := os.FileMode(0o440)
		if e.Name() == domain.AgentTokenFile {
			mode = 0o400 // the token of the agent in the memory: root's only
		}
		if err := os.Chmod(filepath.Join(tmp, e.Name()), mode); err != nil {
			return snapshot.Snapshot{}, err
		}
	}
	if err := os.Rename(tmp, filepath.Join(in.st.Dir, in.name)); err != nil {
		return snapshot.Snapshot{}, err
	}
	ok = true
	return in.st.Get(in.name)
}

// rebaseMeta renames the snapshot in its metadata and points its disk at
// this host's copy of the base image.
func (in *installer) rebaseMeta(ctx context.Context, tmp string) error {
	metaPath := filepath.Join(tmp, snapshot.MetaFile)
	mb, err := os.ReadFile(metaPath)
	if err != nil {
		return fmt.Errorf("artifact has no %s: %w", snapshot.MetaFile, err)
	}
	var s snapshot.Snapshot
	if err := json.Unmarshal(mb, &s); err != nil {
		return fmt.Errorf("artifact %s: %w", snapshot.MetaFile, err)
	}
	newBase := filepath.Join(in.dstImageDir, filepath.Base(s.BaseDisk))
	if filepath.Dir(s.BaseDisk) != in.srcImageDir {
		return fmt.Errorf("artifact: snapshot's base disk %s is not in its image folder %s", s.BaseDisk, in.srcImageDir)
	}
	// The disk's backing file names the source host's path: point it here
	// (-u: the base is the same bytes, only its name changes).
	if out, err := exec.CommandContext(ctx, "qemu-img", "rebase", "-u", "-f", "qcow2", "-F", s.BaseFormat, "-b", newBase,
		filepath.Join(tmp, snapshot.DiskFile)).CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img rebase: %v: %s", err, strings.TrimSpace(string(out)))
	}
	s.Name, s.BaseDisk = in.name, newBase
	mb, err = json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(metaPath, mb, 0o640)
}
