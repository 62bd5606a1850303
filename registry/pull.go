package registry

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/snapshot"
)

// PullResult is what a pull did.
type PullResult struct {
	Snapshot   snapshot.Snapshot `json:"snapshot"`
	Digest     string            `json:"digest"`
	Received   int64             `json:"received_bytes"`
	Cached     int               `json:"cached_parts"` // parts found complete from an earlier try
	ImageReuse bool              `json:"image_reused"` // the base image was already on this host
	Transfer   time.Duration     `json:"transfer_ns"`
	Decode     time.Duration     `json:"decode_ns"`
}

// Inspect reads the manifest at ref and returns its annotations and parts.
func Inspect(ctx context.Context, refStr string, o Options) (v1.Hash, *v1.Manifest, error) {
	ref, err := o.ref(refStr)
	if err != nil {
		return v1.Hash{}, nil, err
	}
	var cnt counter
	desc, err := remote.Get(ref, o.remote(ctx, &cnt)...)
	if err != nil {
		return v1.Hash{}, nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	img, err := desc.Image()
	if err != nil {
		return v1.Hash{}, nil, err
	}
	m, err := img.Manifest()
	if err != nil {
		return v1.Hash{}, nil, err
	}
	if m.Annotations[AnnotKind] != ArtifactType {
		return v1.Hash{}, nil, fmt.Errorf("%s is not a kvbox snapshot (no %s annotation)", ref, AnnotKind)
	}
	return desc.Digest, m, nil
}

// Pull fetches the snapshot at ref into stateDir as snapshot name, after
// checking that this host can restore it. Every blob is checked against
// its digest before anything is listed; the snapshot appears at once
// (rename) or not at all. Blobs already fetched by an interrupted pull
// are kept in the cache and not fetched again.
func Pull(ctx context.Context, conn *libvirt.Connect, stateDir, refStr, name string, o Options) (PullResult, error) {
	var res PullResult
	if err := domain.ValidName(name); err != nil {
		return res, err
	}
	// One pull per name at a time: a second would remove the first's
	// half-made folder when it starts its own.
	lock, err := domain.LockFile(filepath.Join(stateDir, "locks", "pull-"+name+".lock"), false)
	if errors.Is(err, domain.ErrLocked) {
		return res, fmt.Errorf("another kvbox is pulling snapshot %q: %w", name, domain.ErrBusy)
	} else if err != nil {
		return res, err
	}
	defer lock.RemoveAndUnlock()
	st := snapshot.Store{Dir: filepath.Join(stateDir, "snapshots")}
	if _, err := st.Get(name); err == nil {
		return res, fmt.Errorf("snapshot %q %w (kvbox snapshots rm %s, or pull under another name)", name, domain.ErrExists, name)
	}
	dig, m, err := Inspect(ctx, refStr, o)
	if err != nil {
		return res, err
	}
	res.Digest = dig.String()
	var compat Compat
	if err := json.Unmarshal([]byte(m.Annotations[AnnotCompat]), &compat); err != nil {
		return res, fmt.Errorf("%s: bad %s annotation: %w", refStr, AnnotCompat, err)
	}
	if err := compat.Check(conn, o.DomainType); err != nil {
		return res, err
	}
	ref, _ := o.ref(refStr)
	var cnt counter
	ropts := o.remote(ctx, &cnt)
	c := cache{CacheDir(stateDir)}
	if err := os.MkdirAll(c.dir, 0o700); err != nil {
		return res, err
	}
	t0 := time.Now()
	for _, l := range m.Layers {
		if c.verify(l.Digest, l.Size) {
			res.Cached++
			o.logf("  %-24s cached", l.Annotations[AnnotTitle])
			continue
		}
		if err := fetch(ctx, c, ref.Context().Digest(l.Digest.String()), l, ropts, o.Progress); err != nil {
			return res, fmt.Errorf("%s: %w", l.Annotations[AnnotTitle], err)
		}
		o.logf("  %-24s %s fetched and verified", l.Annotations[AnnotTitle], human(l.Size))
	}
	res.Transfer = time.Since(t0)
	res.Received = cnt.recv.Load()

	t1 := time.Now()
	s, reused, err := install(ctx, c, st, stateDir, name, m)
	if err != nil {
		return res, err
	}
	res.Decode = time.Since(t1)
	res.Snapshot, res.ImageReuse = s, reused
	for _, l := range m.Layers { // the snapshot now holds the bytes
		os.Remove(c.blob(l.Digest))
	}
	return res, nil
}

// fetch downloads one blob into the cache, hashing as it goes: a blob
// whose bytes do not match its digest is never kept.
func fetch(ctx context.Context, c cache, dref name.Digest, l v1.Descriptor, ropts []remote.Option, progress func(string, int64, int64)) error {
	layer, err := remote.Layer(dref, ropts...)
	if err != nil {
		return err
	}
	rc, err := layer.Compressed()
	if err != nil {
		return err
	}
	rc = progressReader(rc, l.Annotations[AnnotTitle], l.Size, progress)
	defer rc.Close()
	tmp := c.blob(l.Digest) + ".download"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(f, h), io.LimitReader(rc, l.Size+1))
	if got := hex.EncodeToString(h.Sum(nil)); (err == nil || isVerifyErr(err)) && (got != l.Digest.Hex || n != l.Size) {
		return hashErr(l.Digest, got)
	}
	if err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return os.Rename(tmp, c.blob(l.Digest))
}

func isVerifyErr(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "error verifying") || strings.Contains(err.Error(), "digest"))
}

// install decodes the cached blobs: the base image into images/ (unless
// this host has that version already), the snapshot into a hidden folder
// that is renamed into place once complete, with every path that named the
// source host's state directory rewritten to this one.
func install(ctx context.Context, c cache, st snapshot.Store, stateDir, name string, m *v1.Manifest) (snapshot.Snapshot, bool, error) {
	srcState, srcImageDir, imgName := m.Annotations[AnnotStateDir], m.Annotations[AnnotImageDir], m.Annotations[AnnotImageName]
	if err := domain.ValidName(imgName); err != nil {
		return snapshot.Snapshot{}, false, fmt.Errorf("artifact names a bad image: %w", err)
	}
	version := filepath.Base(srcImageDir)
	if version == "." || version == "/" || strings.HasPrefix(version, ".") {
		return snapshot.Snapshot{}, false, fmt.Errorf("artifact names a bad image folder %q", srcImageDir)
	}
	imgTop := filepath.Join(stateDir, "images", imgName)
	dstImageDir := filepath.Join(imgTop, version)
	parts := map[string][]v1.Descriptor{}
	for _, l := range m.Layers {
		kind, file, ok := strings.Cut(l.Annotations[AnnotTitle], "/")
		if !ok || file == "" || strings.ContainsAny(file, "/\x00") || file[0] == '.' {
			return snapshot.Snapshot{}, false, fmt.Errorf("artifact part with a bad title %q", l.Annotations[AnnotTitle])
		}
		parts[kind] = append(parts[kind], l)
	}
	title := func(l v1.Descriptor) string { _, f, _ := strings.Cut(l.Annotations[AnnotTitle], "/"); return f }
	decodeAll := func(dir string, ls []v1.Descriptor) error {
		for _, l := range ls {
			if err := ctx.Err(); err != nil {
				return err
			}
			f, err := os.Open(c.blob(l.Digest))
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

	// the base image version folder
	reused := false
	if _, err := os.Stat(dstImageDir); err == nil {
		reused = true
		for _, l := range parts["image"] {
			if fi, err := os.Stat(filepath.Join(dstImageDir, title(l))); err != nil || fi.Size() != apparent(l) {
				return snapshot.Snapshot{}, false, fmt.Errorf("image %s version %s exists on this host but differs from the pushed one (%s)", imgName, version, title(l))
			}
		}
	} else {
		if err := os.MkdirAll(imgTop, 0o750); err != nil {
			return snapshot.Snapshot{}, false, err
		}
		tmp := filepath.Join(imgTop, "."+version+".pulling")
		os.RemoveAll(tmp)
		if err := os.Mkdir(tmp, 0o750); err != nil {
			return snapshot.Snapshot{}, false, err
		}
		if err := decodeAll(tmp, parts["image"]); err != nil {
			os.RemoveAll(tmp)
			return snapshot.Snapshot{}, false, err
		}
		for _, f := range []string{"disk.qcow2", "vmlinuz", "initrd.img"} {
			os.Chmod(filepath.Join(tmp, f), 0o440) // base images are immutable, as image import leaves them
		}
		if err := os.Rename(tmp, dstImageDir); err != nil {
			os.RemoveAll(tmp)
			return snapshot.Snapshot{}, false, err
		}
	}
	if _, err := os.Stat(filepath.Join(imgTop, "image.json")); errors.Is(err, os.ErrNotExist) && len(parts["image-meta"]) == 1 {
		tmp := filepath.Join(imgTop, ".image.json.pulling")
		os.Remove(tmp)
		tmpDir, err := os.MkdirTemp(imgTop, ".meta-")
		if err != nil {
			return snapshot.Snapshot{}, false, err
		}
		defer os.RemoveAll(tmpDir)
		if err := decodeAll(tmpDir, parts["image-meta"]); err != nil {
			return snapshot.Snapshot{}, false, err
		}
		b, err := os.ReadFile(filepath.Join(tmpDir, "image.json"))
		if err != nil {
			return snapshot.Snapshot{}, false, err
		}
		b = []byte(strings.ReplaceAll(string(b), srcImageDir+"/", dstImageDir+"/"))
		if err := os.WriteFile(tmp, b, 0o640); err != nil {
			return snapshot.Snapshot{}, false, err
		}
		if err := os.Rename(tmp, filepath.Join(imgTop, "image.json")); err != nil {
			return snapshot.Snapshot{}, false, err
		}
	}

	// the snapshot folder
	if err := os.MkdirAll(st.Dir, 0o750); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	tmp := filepath.Join(st.Dir, "."+name+".pulling")
	os.RemoveAll(tmp)
	if err := os.Mkdir(tmp, 0o750); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	if err := decodeAll(tmp, parts["snapshot"]); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	rewrite := func(s string) string {
		s = strings.ReplaceAll(s, srcImageDir+"/", dstImageDir+"/")
		if srcState != "" && srcState != stateDir {
			s = strings.ReplaceAll(s, srcState+"/", stateDir+"/")
		}
		return s
	}
	xmlPath := filepath.Join(tmp, snapshot.DomainXMLFile)
	xb, err := os.ReadFile(xmlPath)
	if err != nil {
		return snapshot.Snapshot{}, reused, fmt.Errorf("artifact has no %s: %w", snapshot.DomainXMLFile, err)
	}
	if err := os.WriteFile(xmlPath, []byte(rewrite(string(xb))), 0o640); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	metaPath := filepath.Join(tmp, snapshot.MetaFile)
	mb, err := os.ReadFile(metaPath)
	if err != nil {
		return snapshot.Snapshot{}, reused, fmt.Errorf("artifact has no %s: %w", snapshot.MetaFile, err)
	}
	var s snapshot.Snapshot
	if err := json.Unmarshal(mb, &s); err != nil {
		return snapshot.Snapshot{}, reused, fmt.Errorf("artifact %s: %w", snapshot.MetaFile, err)
	}
	newBase := filepath.Join(dstImageDir, filepath.Base(s.BaseDisk))
	if filepath.Dir(s.BaseDisk) != srcImageDir {
		return snapshot.Snapshot{}, reused, fmt.Errorf("artifact: snapshot's base disk %s is not in its image folder %s", s.BaseDisk, srcImageDir)
	}
	// the disk's backing file names the source host's path: point it here
	// (-u: the base is the same bytes, only its name changes)
	if out, err := exec.CommandContext(ctx, "qemu-img", "rebase", "-u", "-f", "qcow2", "-F", s.BaseFormat, "-b", newBase,
		filepath.Join(tmp, snapshot.DiskFile)).CombinedOutput(); err != nil {
		return snapshot.Snapshot{}, reused, fmt.Errorf("qemu-img rebase: %v: %s", err, strings.TrimSpace(string(out)))
	}
	s.Name, s.BaseDisk = name, newBase
	mb, err = json.MarshalIndent(s, "", "  ")
	if err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	if err := os.WriteFile(metaPath, mb, 0o640); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	if err := os.WriteFile(filepath.Join(tmp, CompatFile), []byte(m.Annotations[AnnotCompat]), 0o640); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	if err := syncDir(tmp); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	if err := ctx.Err(); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	// As a made snapshot is sealed: read-only, QEMU's group (snapshots/ is setgid), nothing for others.
	ents, err := os.ReadDir(tmp)
	if err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	for _, e := range ents {
		if err := os.Chmod(filepath.Join(tmp, e.Name()), 0o440); err != nil {
			return snapshot.Snapshot{}, reused, err
		}
	}
	if err := os.Rename(tmp, filepath.Join(st.Dir, name)); err != nil {
		return snapshot.Snapshot{}, reused, err
	}
	ok = true
	got, err := st.Get(name)
	return got, reused, err
}

func apparent(l v1.Descriptor) int64 {
	var n int64
	fmt.Sscan(l.Annotations[AnnotApparent], &n)
	return n
}

func syncDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		f, err := os.OpenFile(filepath.Join(dir, e.Name()), os.O_RDWR, 0)
		if err != nil {
			return err
		}
		err = f.Sync()
		f.Close()
		if err != nil {
			return err
		}
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
