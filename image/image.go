// Package image keeps kvbox's base images: an immutable disk (qcow2 or raw),
// optionally with a kernel, initrd and command line for direct boot, each in
// its own folder under the state directory.
package image

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/statedir"
)

// Image is a registered base image.
type Image struct {
	Name        string    `json:"name"`
	Disk        string    `json:"disk"`
	Format      string    `json:"format"`
	Kernel      string    `json:"kernel,omitempty"`
	Initrd      string    `json:"initrd,omitempty"`
	Cmdline     string    `json:"cmdline,omitempty"`
	VirtualSize int64     `json:"virtual_size_bytes"`
	SizeBytes   int64     `json:"size_bytes"`
	Agent       string    `json:"agent"` // yes, no, or unknown
	Created     time.Time `json:"created"`
}

// Store is the folder of images.
type Store struct{ Dir string }

const metaFile = "image.json"

// Get returns the named image.
func (s Store) Get(name string) (Image, error) {
	var im Image
	if err := s.entries().Read(name, &im); err != nil {
		return Image{}, err
	}
	im.SizeBytes, _ = overlay.Du(filepath.Join(s.Dir, name))
	return im, nil
}

// entries is the store's folder of images: one folder an image (a dot
// folder is a build's work, .build-NAME-*), complete once image.json is in
// it.
func (s Store) entries() statedir.Entries {
	return statedir.Entries{Dir: s.Dir, Record: metaFile, What: "image", Missing: "not found (kvbox images ls lists images)"}
}

// List returns every image, sorted by name.
func (s Store) List() ([]Image, error) {
	out, err := statedir.List(s.Dir, s.Get)
	if err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// ImportOptions says what to register.
type ImportOptions struct {
	Disk    string // a qcow2 or raw disk image
	Kernel  string // optional: boot this kernel directly
	Initrd  string
	Cmdline string
	Agent   string // yes, no or unknown; empty: look inside the disk
	Replace bool
}

// Import copies the files into the store under name. Each import is a new
// version folder (NAME/v-TIME/) that never changes afterwards: boxes and
// snapshots are overlays on a version's disk, so replacing an image leaves
// them on the version they were made from. The image switches to the new
// version only once it is complete, by rewriting NAME/image.json.
func (s Store) Import(name string, o ImportOptions) (Image, error) {
	if err := base.ValidName(name); err != nil {
		return Image{}, err
	}
	if o.Initrd != "" && o.Kernel == "" {
		return Image{}, base.Errorf(base.Invalid, "--initrd needs --kernel")
	}
	imageDir := filepath.Join(s.Dir, name)
	if _, err := os.Stat(filepath.Join(imageDir, metaFile)); err == nil && !o.Replace {
		return Image{}, base.Errorf(base.Exists, "image %q already exists (--replace makes a new version of it)", name)
	}
	info, err := overlay.Info(context.Background(), o.Disk)
	if err != nil {
		return Image{}, base.Errorf(base.Invalid, "disk %s: %v", o.Disk, err)
	}
	if info.Format != "qcow2" && info.Format != "raw" {
		return Image{}, base.Errorf(base.Invalid, "disk %s is %s; kvbox takes qcow2 or raw", o.Disk, info.Format)
	}
	if info.BackingFile != "" {
		return Image{}, base.Errorf(base.Invalid, "disk %s has a backing file; flatten it first (qemu-img convert)", o.Disk)
	}
	if df := info.DataFile(); df != "" {
		// A box on it would read and write that host path.
		return Image{}, base.Errorf(base.Invalid, "disk %s keeps its data in the external file %s; convert it to a self-contained image first (qemu-img convert -O qcow2)", o.Disk, df)
	}
	if err := os.MkdirAll(imageDir, 0o750); err != nil {
		return Image{}, err
	}
	now := time.Now().UTC()
	version := "v-" + now.Format("20060102T150405.000000000")
	tmp := filepath.Join(imageDir, "."+version+".tmp")
	if err := os.Mkdir(tmp, 0o750); err != nil {
		return Image{}, err
	}
	defer os.RemoveAll(tmp)
	final := filepath.Join(imageDir, version)
	im := Image{Name: name, Format: info.Format, Cmdline: o.Cmdline, VirtualSize: info.VirtualSize, Agent: o.Agent, Created: now}
	if im.Agent == "" {
		if im.Agent, err = DetectAgent(context.Background(), o.Disk, info.Format, tmp); err != nil {
			return Image{}, fmt.Errorf("look for kvbox-agent in %s: %w", o.Disk, err)
		}
	}
	copies := []struct {
		src, name string
		dst       *string
	}{{o.Disk, "disk." + info.Format, &im.Disk}, {o.Kernel, "vmlinuz", &im.Kernel}, {o.Initrd, "initrd.img", &im.Initrd}}
	for _, c := range copies {
		if c.src == "" {
			continue
		}
		if _, err := overlay.CopySparse(filepath.Join(tmp, c.name), c.src); err != nil {
			return Image{}, fmt.Errorf("import %s: %w", c.src, err)
		}
		// Base images are immutable: boxes are overlays on them. The
		// group is QEMU's (images/ is setgid), others get nothing.
		if err := os.Chmod(filepath.Join(tmp, c.name), 0o440); err != nil {
			return Image{}, err
		}
		*c.dst = filepath.Join(final, c.name)
	}
	if err := overlay.SyncDir(tmp); err != nil {
		return Image{}, err
	}
	if err := os.Rename(tmp, final); err != nil {
		return Image{}, err
	}
	b, _ := json.MarshalIndent(im, "", "  ")
	if err := overlay.WriteFileAtomic(filepath.Join(imageDir, metaFile), append(b, '\n'), 0o640); err != nil {
		os.RemoveAll(final)
		return Image{}, err
	}
	return s.Get(name)
}

// OldVersionOf names the image that disk is the disk of a version of, when
// that version is not the image's current one (a box or snapshot built on
// it before the image was built again).
func (s Store) OldVersionOf(disk string) (name string, ok bool) {
	version := filepath.Dir(disk)
	imageDir := filepath.Dir(version)
	if filepath.Dir(imageDir) != filepath.Clean(s.Dir) || !strings.HasPrefix(filepath.Base(version), "v-") {
		return "", false
	}
	im, err := s.Get(filepath.Base(imageDir))
	if err != nil || filepath.Dir(im.Disk) == version {
		return "", false
	}
	return im.Name, true
}

// Prune deletes the versions of an image that are neither its current one
// nor in use (inUse gets each version's disk path).
func (s Store) Prune(name string, inUse func(disk string) bool) error {
	im, err := s.Get(name)
	if err != nil {
		return err
	}
	ents, err := os.ReadDir(filepath.Join(s.Dir, name))
	if err != nil {
		return err
	}
	for _, e := range ents {
		dir := filepath.Join(s.Dir, name, e.Name())
		if !e.IsDir() || !strings.HasPrefix(e.Name(), "v-") || dir == filepath.Dir(im.Disk) {
			continue
		}
		matches, _ := filepath.Glob(filepath.Join(dir, "disk.*"))
		used := false
		for _, m := range matches {
			used = used || inUse(m)
		}
		if !used {
			if err := os.RemoveAll(dir); err != nil {
				return err
			}
		}
	}
	return nil
}

// Remove deletes an image with every version. The caller checks first that
// no box or snapshot builds on any of them.
func (s Store) Remove(name string) error {
	if err := base.ValidName(name); err != nil {
		return err
	}
	if _, err := s.Get(name); err != nil {
		return err
	}
	return os.RemoveAll(filepath.Join(s.Dir, name))
}
