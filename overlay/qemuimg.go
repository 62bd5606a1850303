// Package overlay owns kvbox's disk and file work on the host: qcow2 overlays
// through qemu-img (create, inspect, rebase, resize, check), sparse copies of
// RAM files, disk usage, and the fsync/rename helpers that make a snapshot
// directory crash-safe.
package overlay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
)

// QemuImg is the qemu-img binary used; tests and packagers may change it.
var QemuImg = "qemu-img"

// runQemuImg runs qemu-img and returns its stdout; a failure carries the
// command line and qemu-img's stderr.
func runQemuImg(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, QemuImg, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return stdout.Bytes(), &ImgError{Args: args, Err: err, Stderr: strings.TrimSpace(stderr.String())}
	}
	return stdout.Bytes(), nil
}

// ImgError is a failed qemu-img run.
type ImgError struct {
	Args   []string
	Err    error // *exec.ExitError, or the context's error
	Stderr string
}

func (e *ImgError) Error() string {
	msg := fmt.Sprintf("qemu-img %s: %v", strings.Join(e.Args, " "), e.Err)
	if e.Stderr != "" {
		msg += ": " + e.Stderr
	}
	return msg
}

func (e *ImgError) Unwrap() error { return e.Err }

// Create makes a qcow2 overlay at path on top of backingPath, whose format
// (usually "qcow2" or "raw") must be given: qemu-img refuses to probe it.
// backingPath is stored as given; a relative one is resolved from the
// overlay's directory when the image is opened. The overlay gets the
// backing file's virtual size.
func Create(ctx context.Context, path, backingPath, backingFmt string) error {
	return CreateLarger(ctx, path, backingPath, backingFmt, 0)
}

// CreateLarger is Create with a virtual size of its own (0: the backing
// file's), in one qemu-img run.
func CreateLarger(ctx context.Context, path, backingPath, backingFmt string, size int64) error {
	if backingPath == "" || backingFmt == "" {
		return fmt.Errorf("overlay: create %s: backing path and format are required", path)
	}
	args := []string{"create", "-q", "-f", "qcow2", "-F", backingFmt, "-b", backingPath, path}
	if size > 0 {
		args = append(args, strconv.FormatInt(size, 10))
	}
	_, err := runQemuImg(ctx, args...)
	return err
}

// CreateSized makes a standalone qcow2 image of size bytes.
func CreateSized(ctx context.Context, path string, size int64) error {
	return withSize(ctx, "create", path, size)
}

// withSize runs qemu-img VERB on the qcow2 image at path with a size of
// size bytes, which must be positive (create, resize).
func withSize(ctx context.Context, verb, path string, size int64) error {
	if size <= 0 {
		return fmt.Errorf("overlay: %s %s: size %d must be positive", verb, path, size)
	}
	_, err := runQemuImg(ctx, verb, "-q", "-f", "qcow2", path, strconv.FormatInt(size, 10))
	return err
}

// ImageInfo is what `qemu-img info --output=json` reports about one image.
type ImageInfo struct {
	Filename        string `json:"filename"`
	Format          string `json:"format"`
	VirtualSize     int64  `json:"virtual-size"`
	ActualSize      int64  `json:"actual-size"`
	ClusterSize     int64  `json:"cluster-size,omitempty"`
	DirtyFlag       bool   `json:"dirty-flag"`
	BackingFile     string `json:"backing-filename,omitempty"`
	FullBackingFile string `json:"full-backing-filename,omitempty"`
	BackingFormat   string `json:"backing-filename-format,omitempty"`
	FormatSpecific  *struct {
		Type string `json:"type"`
		Data struct {
			Compat  string `json:"compat,omitempty"`
			Corrupt bool   `json:"corrupt,omitempty"`
			// DataFile is a qcow2 external data file: the guest's
			// blocks live in that host path, not in the image.
			DataFile string   `json:"data-file,omitempty"`
			Bitmaps  []Bitmap `json:"bitmaps,omitempty"`
		} `json:"data"`
	} `json:"format-specific,omitempty"`
}

// Bitmap is a persistent dirty bitmap stored in a qcow2 image.
type Bitmap struct {
	Name        string   `json:"name"`
	Granularity int64    `json:"granularity"`
	Flags       []string `json:"flags"`
}

// Bitmaps lists the image's persistent dirty bitmaps (qcow2 only).
func (i ImageInfo) Bitmaps() []Bitmap {
	if i.FormatSpecific == nil {
		return nil
	}
	return i.FormatSpecific.Data.Bitmaps
}

// DataFile is the qcow2 image's external data file, "" for none.
func (i ImageInfo) DataFile() string {
	if i.FormatSpecific == nil {
		return ""
	}
	return i.FormatSpecific.Data.DataFile
}

// Info describes the image at path. It opens the image with --force-share so
// it also works on the disk of a running box (the numbers are then a moment's
// view).
func Info(ctx context.Context, path string) (ImageInfo, error) {
	out, err := runQemuImg(ctx, "info", "--output=json", "--force-share", path)
	if err != nil {
		return ImageInfo{}, err
	}
	var info ImageInfo
	if err := json.Unmarshal(out, &info); err != nil {
		return ImageInfo{}, fmt.Errorf("overlay: decode qemu-img info of %s: %w", path, err)
	}
	return info, nil
}

// InfoChain describes the image at path and every image behind it, top first.
func InfoChain(ctx context.Context, path string) ([]ImageInfo, error) {
	out, err := runQemuImg(ctx, "info", "--output=json", "--force-share", "--backing-chain", path)
	if err != nil {
		return nil, err
	}
	var chain []ImageInfo
	if err := json.Unmarshal(out, &chain); err != nil {
		return nil, fmt.Errorf("overlay: decode qemu-img info --backing-chain of %s: %w", path, err)
	}
	return chain, nil
}

// Rebase points the qcow2 image at path to newBacking (format backingFmt).
// A safe rebase (unsafe false) first copies into the image every cluster
// whose content differs between the old chain and newBacking, so the guest
// sees the same data: this is how a snapshot's incremental image becomes
// standalone above the base. newBacking "" makes the image fully standalone.
// An unsafe rebase only rewrites the backing file name, for when the caller
// knows the data is the same (a file moved).
func Rebase(ctx context.Context, path, newBacking, backingFmt string, unsafe bool) error {
	args := []string{"rebase", "-q", "-f", "qcow2"}
	if unsafe {
		args = append(args, "-u")
	}
	if newBacking != "" {
		if backingFmt == "" {
			return fmt.Errorf("overlay: rebase %s: backing format required", path)
		}
		args = append(args, "-F", backingFmt)
	}
	args = append(args, "-b", newBacking, path)
	_, err := runQemuImg(ctx, args...)
	return err
}

// Resize sets the qcow2 image's virtual size. Shrinking is refused by
// qemu-img (it would need --shrink, which kvbox never passes: it loses data).
func Resize(ctx context.Context, path string, size int64) error {
	return withSize(ctx, "resize", path, size)
}

// CheckResult is `qemu-img check --output=json`'s report.
type CheckResult struct {
	Filename         string `json:"filename"`
	Format           string `json:"format"`
	CheckErrors      int64  `json:"check-errors"`
	Corruptions      int64  `json:"corruptions,omitempty"`
	Leaks            int64  `json:"leaks,omitempty"`
	AllocatedCluster int64  `json:"allocated-clusters,omitempty"`
	TotalClusters    int64  `json:"total-clusters,omitempty"`
}

// ErrCorrupt is wrapped by Check's error when the image has corruptions or
// check errors. Leaked clusters only waste space and are not an error.
var ErrCorrupt = errors.New("image is corrupt")

// Check runs qemu-img check on the qcow2 image at path (read-only, no repair).
func Check(ctx context.Context, path string) (CheckResult, error) {
	out, err := runQemuImg(ctx, "check", "-f", "qcow2", "--output=json", path)
	var res CheckResult
	// Exit status 2 (corruptions) and 3 (leaks) still print the report.
	if jerr := json.Unmarshal(out, &res); jerr != nil {
		if err != nil {
			return res, err
		}
		return res, fmt.Errorf("overlay: decode qemu-img check of %s: %w", path, jerr)
	}
	if res.Corruptions > 0 || res.CheckErrors > 0 {
		return res, fmt.Errorf("overlay: %s: %d corruptions, %d check errors: %w", path, res.Corruptions, res.CheckErrors, ErrCorrupt)
	}
	var exitErr *exec.ExitError
	if err != nil && !(errors.As(err, &exitErr) && exitErr.ExitCode() == 3) {
		return res, err
	}
	return res, nil
}
