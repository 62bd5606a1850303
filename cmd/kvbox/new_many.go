package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/kvbox"
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

// runNewMany is `kvbox new --count N PREFIX` (and `new --json`): every
// name is valid (runNew checked) and free, or none is started; then the
// boxes start in parallel, each with its own outcome (a failed one is
// removed, the others keep running).
func (a *app) runNewMany(c *cobra.Command, o *newOptions, names []string) error {
	start := time.Now()
	from := "image " + o.image
	if o.from != "" {
		from = "snapshot " + o.from
	}
	k, err := a.lib()
	if err != nil {
		return err
	}
	var outcomes []kvbox.Outcome
	if o.from != "" {
		outcomes, err = k.CloneMany(c.Context(), kvbox.CloneRequest{Snapshot: o.from, Expires: o.expires, Egress: o.policy,
			AgentTimeout: o.timeout, HooksTimeout: o.hooksTimeout, Progress: a.reporter()}, names)
	} else {
		mem, disk, serr := o.sizes()
		if serr != nil {
			return serr
		}
		if err := a.ensureImage(c, o.image); err != nil {
			return err
		}
		outcomes, err = k.CreateMany(c.Context(), kvbox.CreateRequest{Image: o.image, CPUs: o.cpus, MemoryBytes: mem, DiskBytes: disk,
			Network: o.network, Expires: o.expires, Egress: o.policy, AgentTimeout: o.timeout, Progress: a.reporter()}, names)
	}
	if err != nil {
		return err
	}
	results := make([]newResult, len(outcomes))
	for i, oc := range outcomes {
		r := newResult{Name: oc.Name, From: from, Seconds: oc.Took.Seconds(), err: oc.Err}
		if oc.Timings != nil {
			r.timing = oc.Timings.String()
		}
		if oc.Err != nil {
			r.Error = oc.Err.Error()
		} else {
			r.OK, r.IP, r.MAC, r.Expires = true, oc.Box.IP, oc.Box.MAC, oc.Box.Expires
		}
		results[i] = r
	}
	if err := a.printNewResults(o, from, results, time.Since(start)); err != nil {
		return err
	}
	return kvbox.Failed(outcomes)
}

// sizes are --memory and --disk in bytes.
func (o *newOptions) sizes() (mem, disk int64, err error) {
	if mem, err = base.ParseSize(o.memory); err != nil {
		return 0, 0, err
	}
	disk, err = base.ParseSize(o.disk)
	return mem, disk, err
}

// printNewResults prints a line (or a JSON element) per box, then a summary.
func (a *app) printNewResults(o *newOptions, from string, results []newResult, took time.Duration) error {
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
		fmt.Fprintf(a.io.Out, "%d of %d boxes running from %s (%.2fs)\n", ok, len(results), from, took.Seconds())
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
