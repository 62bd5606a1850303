package terminal

import (
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/progress"
)

// Copy is a copy's progress.Reporter: it tells warn what the copy skipped
// and, on a terminal, draws one status line with the copy's bytes once the
// copy has run for a while (NewCopy).
type Copy struct {
	warn  func(string)
	w     io.Writer // nil: not a terminal
	after time.Duration
	start time.Time
	done  atomic.Int64
	total atomic.Int64
	quit  chan struct{}
	once  sync.Once
	wg    sync.WaitGroup
	drawn atomic.Bool
}

// NewCopy draws on w, a terminal (nil: none), once the copy has run for
// after; Log lines go to warn.
func NewCopy(w io.Writer, after time.Duration, warn func(string)) *Copy {
	p := &Copy{warn: warn, w: w, after: after, quit: make(chan struct{})}
	p.total.Store(-1)
	return p
}

func (p *Copy) Log(s string) { p.warn(s) }

// Stage starts the copy's status line.
func (p *Copy) Stage(string) progress.Stage {
	p.start = time.Now()
	if p.w != nil {
		p.wg.Add(1)
		go p.loop()
	}
	return p
}

func (p *Copy) Status(string) {}

func (p *Copy) Bytes(done, total int64) {
	p.done.Store(done)
	p.total.Store(total)
}

func (p *Copy) End() { p.Stop() }

func (p *Copy) loop() {
	defer p.wg.Done()
	draw := func() {
		if time.Since(p.start) >= p.after {
			fmt.Fprint(p.w, "\r\033[K  "+p.line())
			p.drawn.Store(true)
		}
	}
	draw()
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.quit:
			return
		case <-t.C:
			draw()
		}
	}
}

func (p *Copy) line() string {
	done, total := p.done.Load(), p.total.Load()
	secs := time.Since(p.start).Seconds()
	rate := ""
	if secs > 0 {
		rate = fmt.Sprintf(" at %s/s", base.FormatSize(int64(float64(done)/secs)))
	}
	if total > 0 {
		return fmt.Sprintf("%s of %s (%d%%)%s", base.FormatSize(min(done, total)), base.FormatSize(total), min(done, total)*100/total, rate)
	}
	return fmt.Sprintf("%s%s", base.FormatSize(done), rate)
}

// Stop clears the status line.
func (p *Copy) Stop() {
	p.once.Do(func() {
		close(p.quit)
		p.wg.Wait()
		if p.drawn.Load() {
			fmt.Fprint(p.w, "\r\033[K")
		}
	})
}

// Summary prints, on a terminal and for a copy that showed progress, what
// was moved and how fast.
func (p *Copy) Summary() {
	if p.drawn.Load() {
		fmt.Fprintf(p.w, "copied %s in %.1fs\n", p.line(), time.Since(p.start).Seconds())
	}
}
