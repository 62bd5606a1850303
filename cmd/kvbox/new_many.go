package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/snapshot"
)

// newResult is one box of `kvbox new --count`: its address, or its error.
type newResult struct {
	Name    string  `json:"name"`
	OK      bool    `json:"ok"`
	IP      string  `json:"ip,omitempty"`
	MAC     string  `json:"mac,omitempty"`
	From    string  `json:"from"`
	Seconds float64 `json:"seconds"`
	Error   string  `json:"error,omitempty"`
	// Expires is the box's deadline (--ttl).
	Expires *time.Time `json:"expires,omitempty"`
	err     error
	timing  string
}

// starter starts one box by name; from is what it starts from ("snapshot
// warm", "image tiny").
type starter struct {
	from  string
	start func(ctx context.Context, name string) (domain.Box, string, error)
}

// countNames are the names of --count n: prefix-1 .. prefix-n.
func countNames(prefix string, n int) ([]string, error) {
	if n < 1 {
		return nil, fmt.Errorf("%w: --count %d: give 1 or more", errUsage, n)
	}
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("%s-%d", prefix, i+1)
		if err := base.ValidName(names[i]); err != nil {
			return nil, fmt.Errorf("--count %d with prefix %q: %w", n, prefix, err)
		}
	}
	return names, nil
}

// newStarter checks the flags of `new` and finds the image or snapshot, so
// that nothing is started when one of them is wrong.
func (a *app) newStarter(c *cobra.Command, o *newOptions, h *domain.Host) (starter, error) {
	if o.from != "" {
		for _, f := range []string{"image", "cpus", "memory", "disk"} {
			if c.Flags().Changed(f) {
				return starter{}, fmt.Errorf("%w: --%s does not apply to --from: a clone has its snapshot's image, vCPUs, RAM and disk", errUsage, f)
			}
		}
		snap, err := a.snapshots().Get(o.from)
		if err != nil {
			return starter{}, err
		}
		if err := checkHostFor(h, snap); err != nil {
			return starter{}, err
		}
		return starter{from: "snapshot " + snap.Name, start: func(ctx context.Context, name string) (domain.Box, string, error) {
			b, tm, err := snapshot.CloneWith(ctx, h, snap, name, snapshot.CloneOptions{AgentTimeout: o.timeout, HooksDeadline: o.hooksTimeout})
			return b, tm.String(), err
		}}, nil
	}
	mem, err := base.ParseSize(o.memory)
	if err != nil {
		return starter{}, err
	}
	disk, err := base.ParseSize(o.disk)
	if err != nil {
		return starter{}, err
	}
	im, err := a.images().Get(o.image)
	if errors.Is(err, base.ErrNotFound) && o.image == image.DefaultImage {
		fmt.Fprintf(a.io.Err, "image %s is missing: building it first (kvbox images build %s)\n", o.image, o.image)
		im, err = image.EnsureDebian(c.Context(), a.images(), image.DebianOptions{Progress: &image.Progress{W: a.raw.Err, TTY: a.io.TTY, Text: printable}})
	}
	if err != nil {
		return starter{}, err
	}
	if im.Agent == "no" {
		return starter{}, base.Errorf(base.Invalid, "image %q has no kvbox-agent; install bin/kvbox-agent in it as a service and import it again with --agent yes", im.Name)
	}
	return starter{from: "image " + im.Name, start: func(ctx context.Context, name string) (domain.Box, string, error) {
		b, err := h.Create(ctx, domain.Spec{
			Name: name, CPUs: o.cpus, MemoryBytes: mem, DiskBytes: disk, AgentTimeout: o.timeout, NoNetwork: o.network == "none", Group: o.group(),
			Boot: domain.Boot{Image: im.Name, Disk: im.Disk, DiskFormat: im.Format, VirtualSize: im.VirtualSize,
				Kernel: im.Kernel, Initrd: im.Initrd, Cmdline: im.Cmdline},
		})
		return b, "", err
	}}, nil
}

// runNewMany is `kvbox new --count N PREFIX` (and `new --json`): every name
// is checked first, and if one is invalid or taken none is started; then
// the boxes start in parallel, each with its own outcome (a failed one is
// rolled back by Create or Clone, the others keep running).
func (a *app) runNewMany(c *cobra.Command, o *newOptions) error {
	start := time.Now()
	names := []string{o.name}
	if c.Flags().Changed("count") {
		var err error
		if names, err = countNames(o.name, o.count); err != nil {
			return err
		}
	} else if err := base.ValidName(o.name); err != nil {
		return err
	}
	if err := o.checkNetwork(c); err != nil {
		return err
	}
	h, err := a.Host()
	if err != nil {
		return err
	}
	st, err := a.newStarter(c, o, h)
	if err != nil {
		return err
	}
	if err := allFree(h, o.name, names); err != nil {
		return err
	}
	stop := a.spin(fmt.Sprintf("starting %d boxes from %s", len(names), st.from))
	results := a.startAll(c, h, st, o, names)
	stop()
	if err := a.printNewResults(o, st, results, time.Since(start)); err != nil {
		return err
	}
	return manyError(results)
}

// allFree refuses the names if any is taken, before anything starts.
func allFree(h *domain.Host, prefix string, names []string) error {
	var taken []string
	var first error
	for _, n := range names {
		if err := h.NameFree(n); err != nil {
			taken = append(taken, n)
			if first == nil {
				first = err
			}
		}
	}
	if len(taken) == 0 {
		return nil
	}
	if len(names) == 1 {
		return first
	}
	return failedError{fmt.Sprintf("%s already taken (a box or domain has that name): started none of %s-1 .. %s-%d",
		strings.Join(taken, ", "), prefix, prefix, len(names)), first}
}

// startAll starts the boxes in parallel, each with its own outcome.
func (a *app) startAll(c *cobra.Command, h *domain.Host, st starter, o *newOptions, names []string) []newResult {
	// A clone spends much of its time waiting (libvirt, QEMU's start, the
	// agent): twice the cores keeps the host busy without a storm of boots.
	slots := make(chan struct{}, min(len(names), max(2, 2*runtime.NumCPU())))
	results := make([]newResult, len(names))
	var wg sync.WaitGroup
	for i, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slots <- struct{}{}
			defer func() { <-slots }()
			t0 := time.Now()
			b, tm, err := st.start(c.Context(), n)
			if err == nil && o.expires != nil {
				b, err = a.setBoxTTL(c.Context(), n, *o.expires)
			}
			r := newResult{Name: n, From: st.from, Seconds: time.Since(t0).Seconds(), err: err, timing: tm}
			if err != nil {
				r.Error = message(err)
			} else {
				r.OK, r.IP, r.MAC, r.Expires = true, b.IP, b.MAC, b.Expires
			}
			results[i] = r
		}()
	}
	wg.Wait()
	return results
}

// printNewResults prints a line (or a JSON element) per box, then a summary.
func (a *app) printNewResults(o *newOptions, st starter, results []newResult, took time.Duration) error {
	if o.asJSON {
		if err := a.printJSON(results); err != nil {
			return err
		}
	} else {
		ok := 0
		for _, r := range results {
			if r.OK {
				ok++
				fmt.Fprintf(a.io.Out, "✓ box %s is running at %s (%.2fs)\n", r.Name, r.IP, r.Seconds)
			} else {
				fmt.Fprintf(a.io.Out, "✗ box %s failed: %s\n", r.Name, r.Error)
			}
		}
		fmt.Fprintf(a.io.Out, "%d of %d boxes running from %s (%.2fs)\n", ok, len(results), st.from, took.Seconds())
	}
	if o.verbose {
		for _, r := range results {
			if r.timing != "" {
				fmt.Fprintf(a.io.Err, "timing %s: %s\n", r.Name, r.timing)
			}
		}
	}
	return nil
}

// manyError is the outcome of a --count run: the first failure's error,
// with a line saying which boxes failed and that they were removed.
func manyError(results []newResult) error {
	var failed []string
	var first error
	for _, r := range results {
		if r.err != nil {
			failed = append(failed, r.Name)
			if first == nil {
				first = r.err
			}
		}
	}
	switch {
	case first == nil:
		return nil
	case len(results) == 1:
		return first
	case len(failed) == len(results):
		return failedError{fmt.Sprintf("could not start any of the %d boxes (each one removed)", len(results)), first}
	}
	return failedError{fmt.Sprintf("could not start %s (removed; the other %d are running)", strings.Join(failed, ", "), len(results)-len(failed)), first}
}
