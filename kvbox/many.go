package kvbox

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/progress"
	"kvbox.dev/kvbox/step"
)

// Outcome is what became of one box of many: the box, or its error (and
// whatever it left behind is removed).
type Outcome struct {
	Name    string
	Box     Box
	Timings step.Timings
	Took    time.Duration
	Err     error
}

// Names are the names of n boxes with prefix: prefix-1 .. prefix-n.
func Names(prefix string, n int) ([]string, error) {
	if n < 1 {
		return nil, base.Errorf(base.Invalid, "--count %d: give 1 or more", n)
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

// CreateMany boots one box of req per name, in parallel. Every name must
// be valid and free and the image there, or none is started (the error);
// then each box has its own outcome: a failed one is removed, the others
// keep running. req.Name and req.Publish are not used.
func (h *Host) CreateMany(ctx context.Context, req CreateRequest, names []string) ([]Outcome, error) {
	return h.startMany(ctx, names, req.Publish, req.Progress, req.Expires, func() (string, startFunc, error) {
		req.Name = names[0]
		spec, err := h.spec(req)
		if err == nil {
			err = h.ensureEgressFor(req.Egress)
		}
		return "image " + spec.Boot.Image, func(ctx context.Context, name string) (domain.Box, step.Timings, error) {
			s := spec
			s.Name = name
			return h.d.CreateTimed(ctx, s)
		}, err
	})
}

// CloneMany starts one warm clone of req per name, in parallel, as
// CreateMany does. req.Name and req.Publish are not used.
func (h *Host) CloneMany(ctx context.Context, req CloneRequest, names []string) ([]Outcome, error) {
	return h.startMany(ctx, names, req.Publish, req.Progress, req.Expires, func() (string, startFunc, error) {
		req.Name = names[0]
		snap, err := h.cloneable(req)
		if err == nil {
			err = h.ensureEgressFor(h.cloneEgress(snap, req.Egress))
		}
		return "snapshot " + snap.Name, func(ctx context.Context, name string) (domain.Box, step.Timings, error) {
			r := req
			r.Name = name
			return h.clone(ctx, snap, r)
		}, err
	})
}

// startFunc makes one box of many.
type startFunc func(ctx context.Context, name string) (domain.Box, step.Timings, error)

// startMany starts one box per name, in parallel: what prepare checks
// (the request, with the first name) says from what and how; every name
// must be free, or none is started.
func (h *Host) startMany(ctx context.Context, names []string, publish []Port, p progress.Reporter, expires *time.Time,
	prepare func() (from string, start startFunc, err error)) ([]Outcome, error) {
	if len(publish) > 0 {
		return nil, base.Errorf(base.Invalid, "--publish starts one box's forwards: it does not go with --count or --json")
	}
	from, start, err := prepare()
	if err != nil {
		return nil, err
	}
	if err := h.allFree(names); err != nil {
		return nil, err
	}
	st := progress.Of(p).Stage(fmt.Sprintf("starting %d boxes from %s", len(names), from))
	defer st.End()
	return h.startAll(ctx, names, start, expires), nil
}

// allFree refuses the names if any is taken, before anything starts.
func (h *Host) allFree(names []string) error {
	var taken []string
	var first error
	for _, n := range names {
		if err := base.ValidName(n); err != nil {
			return err
		}
		if err := h.d.NameFree(n); err != nil {
			taken = append(taken, n)
			if first == nil {
				first = err
			}
		}
	}
	if len(taken) == 0 || len(names) == 1 {
		return first
	}
	return &ManyError{fmt.Sprintf("%s already taken (a box or domain has that name): started none of %s .. %s",
		strings.Join(taken, ", "), names[0], names[len(names)-1]), first}
}

// startAll starts the boxes in parallel, each with its own outcome.
func (h *Host) startAll(ctx context.Context, names []string, start startFunc, expires *time.Time) []Outcome {
	// A clone spends much of its time waiting (libvirt, QEMU's start, the
	// agent): twice the cores keeps the host busy without a storm of boots.
	slots := make(chan struct{}, min(len(names), max(2, 2*runtime.NumCPU())))
	out := make([]Outcome, len(names))
	var wg sync.WaitGroup
	for i, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slots <- struct{}{}
			defer func() { <-slots }()
			t0 := time.Now()
			o := Outcome{Name: n}
			var b domain.Box
			if b, o.Timings, o.Err = start(ctx, n); o.Err == nil {
				o.Box, o.Err = h.finish(ctx, b, expires, nil, nil)
			}
			o.Took = time.Since(t0)
			out[i] = o
		}()
	}
	wg.Wait()
	return out
}

// ManyError is the failure of several boxes in one line; its kind is that
// of Cause, the first failure.
type ManyError struct {
	Msg   string
	Cause error
}

func (e *ManyError) Error() string { return e.Msg }
func (e *ManyError) Unwrap() error { return e.Cause }

// Failed is the error of a run of CreateMany or CloneMany: nil when every
// box made it, the only failure's when there was one box, else a
// ManyError saying which failed.
func Failed(outcomes []Outcome) error {
	var failed []string
	var first error
	for _, o := range outcomes {
		if o.Err != nil {
			failed = append(failed, o.Name)
			if first == nil {
				first = o.Err
			}
		}
	}
	switch {
	case first == nil:
		return nil
	case len(outcomes) == 1:
		return first
	case len(failed) == len(outcomes):
		return &ManyError{fmt.Sprintf("could not start any of the %d boxes (each one removed)", len(outcomes)), first}
	}
	return &ManyError{fmt.Sprintf("could not start %s (removed; the other %d are running)", strings.Join(failed, ", "), len(outcomes)-len(failed)), first}
}
