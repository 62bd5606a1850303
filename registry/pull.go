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
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/progress"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/statedir"
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
// checking that this host can restore it. The artifact is untrusted
// (untrusted.go): its manifest is checked before anything is fetched, its
// metadata parts are fetched and checked before the others, and what they
// declare is held against this host's free space. Every blob is checked
// against its digest before anything is listed; the snapshot appears at
// once (rename) or not at all. Blobs already fetched by an interrupted pull
// are kept in the cache and not fetched again.
func Pull(ctx context.Context, conn *libvirt.Connect, stateDir, refStr, name string, o Options) (PullResult, error) {
	var res PullResult
	lock, st, err := lockPull(stateDir, name)
	if err != nil {
		return res, err
	}
	defer lock.RemoveAndUnlock()
	dig, m, err := Inspect(ctx, refStr, o)
	if err != nil {
		return res, err
	}
	res.Digest = dig.String()
	p, err := checkArtifact(conn, refStr, m, o.DomainType)
	if err != nil {
		return res, err
	}
	if err := o.checkPartCaps(p); err != nil {
		return res, fmt.Errorf("pull of %s refused: %w", refStr, err)
	}
	ref, _ := o.ref(refStr)
	var cnt counter
	f := fetcher{ctx: ctx, c: cache{statedir.Layout{Root: stateDir}.RegistryCache()}, ref: ref, ropts: o.remote(ctx, &cnt), o: o, res: &res}
	if err := os.MkdirAll(f.c.dir, 0o700); err != nil {
		return res, err
	}
	// The snapshot's metadata first: what it says bounds the rest.
	small, rest, smallBytes := metaFirst(p)
	if err := checkSpace(stateDir, smallBytes); err != nil {
		return res, fmt.Errorf("pull of %s refused: %w", refStr, err)
	}
	t0 := time.Now()
	if err := f.get(small); err != nil {
		return res, err
	}
	in, err := prepare(f.c, st, stateDir, name, p, o)
	if err != nil {
		return res, refusal(refStr, err)
	}
	if err := in.checkSpace(f.c.missing(rest)); err != nil {
		return res, refusal(refStr, err)
	}
	if err := f.get(rest); err != nil {
		return res, err
	}
	res.Transfer = time.Since(t0)
	res.Received = cnt.recv.Load()

	t1 := time.Now()
	s, err := in.install(ctx)
	if err != nil {
		return res, refusal(refStr, err)
	}
	res.Decode = time.Since(t1)
	res.Snapshot, res.ImageReuse = s, in.reuse
	for _, l := range m.Layers { // the snapshot now holds the bytes
		os.Remove(f.c.blob(l.Digest))
	}
	return res, nil
}

// lockPull checks name and takes its pull lock, and refuses a name a
// snapshot of this host has: the caller releases the lock
// (RemoveAndUnlock). One pull per name at a time: a second would remove
// the first's half-made folder when it starts its own.
func lockPull(stateDir, name string) (*base.FileLock, snapshot.Store, error) {
	st := snapshot.Store{Dir: statedir.Layout{Root: stateDir}.Snapshots()}
	if err := base.ValidName(name); err != nil {
		return nil, st, err
	}
	lock, err := base.Lock(statedir.Layout{Root: stateDir}.PullLock(name), false)
	if errors.Is(err, base.ErrLocked) {
		return nil, st, base.Errorf(base.Busy, "another kvbox is pulling snapshot %q", name)
	} else if err != nil {
		return nil, st, err
	}
	if _, err := st.Get(name); err == nil {
		lock.RemoveAndUnlock()
		return nil, st, base.Errorf(base.Exists, "snapshot %q already exists (kvbox snapshots rm %s, or pull under another name)", name, name)
	}
	return lock, st, nil
}

// checkArtifact refuses the artifact of manifest m unless this host can
// restore it (its compatibility record) and its manifest is one kvbox
// pushes (checkManifest): what to fetch, part by part.
func checkArtifact(conn *libvirt.Connect, refStr string, m *v1.Manifest, domainType string) (*plan, error) {
	var compat snapshot.Compat
	if err := json.Unmarshal([]byte(m.Annotations[AnnotCompat]), &compat); err != nil {
		return nil, fmt.Errorf("%s: bad %s annotation: %w", refStr, AnnotCompat, err)
	}
	if err := compat.Check(conn, domainType); err != nil {
		return nil, err
	}
	p, err := checkManifest(m)
	if err != nil {
		return nil, fmt.Errorf("pull of %s refused: %w", refStr, err)
	}
	return p, nil
}

// metaFirst sorts the artifact's parts into its metadata (small, and how
// many bytes they declare) and the rest, each in the manifest's order.
func metaFirst(p *plan) (small, rest []part, smallBytes int64) {
	for _, t := range p.titles {
		if slices.Contains(metaParts, t) {
			small = append(small, p.parts[t])
			smallBytes += p.parts[t].desc.Size
		} else {
			rest = append(rest, p.parts[t])
		}
	}
	return small, rest, smallBytes
}

// missing is how many bytes of ps are not in the cache yet (fetcher.get
// verifies those it finds).
func (c cache) missing(ps []part) int64 {
	var n int64
	for _, pt := range ps {
		if fi, err := os.Stat(c.blob(pt.desc.Digest)); err != nil || fi.Size() != pt.desc.Size {
			n += pt.desc.Size
		}
	}
	return n
}

// fetcher brings a pull's parts into the cache.
type fetcher struct {
	ctx   context.Context
	c     cache
	ref   name.Reference
	ropts []remote.Option
	o     Options
	res   *PullResult // counts the parts found cached
}

// get fetches each of ps not in the cache complete already, and checks it
// against its digest.
func (f fetcher) get(ps []part) error {
	for _, pt := range ps {
		l := pt.desc
		if f.c.verify(l.Digest, l.Size) {
			f.res.Cached++
			f.o.logf("  %-24s cached", pt.title)
			continue
		}
		if err := fetch(f.ctx, f.c, f.ref.Context().Digest(l.Digest.String()), l, f.ropts, f.o.Progress); err != nil {
			return fmt.Errorf("%s: %w", pt.title, err)
		}
		f.o.logf("  %-24s %s fetched and verified", pt.title, human(l.Size))
	}
	return nil
}

// refusal says which pull an artifact's refusal is of.
func refusal(ref string, err error) error {
	if errors.Is(err, base.ErrInvalid) {
		return fmt.Errorf("pull of %s refused: %w", ref, err)
	}
	return err
}

// fetch downloads one blob into the cache, hashing as it goes: a blob
// whose bytes do not match its digest is never kept.
func fetch(ctx context.Context, c cache, dref name.Digest, l v1.Descriptor, ropts []remote.Option, rep progress.Reporter) error {
	layer, err := remote.Layer(dref, ropts...)
	if err != nil {
		return err
	}
	rc, err := layer.Compressed()
	if err != nil {
		return err
	}
	rc = progressReader(rc, l.Annotations[AnnotTitle], l.Size, rep)
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
