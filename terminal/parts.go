package terminal

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"time"

	"kvbox.dev/kvbox/base"
)

// Parts draws, on a terminal, one status line with every part in
// flight (a push or pull moves several at once): "snapshot/memory 45% of
// 27 MB". Lines written through it (the per-part log) first clear the
// status line, so the two never mix.
type Parts struct {
	mu    sync.Mutex
	w     io.Writer
	parts map[string][2]int64 // title -> done, total
	drawn time.Time
	shown bool
}

// NewParts draws on w, a terminal.
func NewParts(w io.Writer) *Parts {
	return &Parts{w: w, parts: map[string][2]int64{}}
}

// Update records a part's bytes done of total and redraws at most ten
// times a second; a part is dropped from the line when it is complete.
func (p *Parts) Update(title string, done, total int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if done >= total {
		delete(p.parts, title)
	} else {
		p.parts[title] = [2]int64{done, total}
	}
	if time.Since(p.drawn) < 100*time.Millisecond && done < total {
		return
	}
	p.drawn = time.Now()
	p.draw()
}

func (p *Parts) draw() {
	titles := make([]string, 0, len(p.parts))
	for t := range p.parts {
		titles = append(titles, t)
	}
	sort.Strings(titles)
	var items []string
	for _, t := range titles {
		v := p.parts[t]
		pct := 0
		if v[1] > 0 {
			pct = int(v[0] * 100 / v[1])
		}
		items = append(items, fmt.Sprintf("%s %d%% of %s", Printable(t), pct, base.FormatSize(v[1])))
	}
	fmt.Fprint(p.w, "\r\033[K")
	p.shown = len(items) > 0
	if p.shown {
		fmt.Fprint(p.w, "  "+strings.Join(items, " · "))
	}
}

// Write prints a log line above the status line.
func (p *Parts) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.shown {
		fmt.Fprint(p.w, "\r\033[K")
	}
	n, err := Writer{p.w}.Write(b)
	if p.shown {
		p.draw()
	}
	return n, err
}

// Done clears the status line.
func (p *Parts) Done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.shown {
		fmt.Fprint(p.w, "\r\033[K")
		p.shown = false
	}
}
