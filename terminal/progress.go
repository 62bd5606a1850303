package terminal

import (
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"golang.org/x/term"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/progress"
)

// Options say where a Progress writes.
type Options struct {
	// Term is the terminal the live lines are drawn on, raw (cursor
	// controls; their text is made printable here); nil draws nothing,
	// as when standard error is not a terminal (IfTerminal).
	Term io.Writer
	// Log is where log lines go, one a line, terminal or not (nil:
	// nowhere); on a terminal, the one Term draws on, so that a log line
	// lands above the live lines.
	Log io.Writer
	// Prefix starts every log line ("kvbox: cp: ").
	Prefix string
	// After is how long a stage runs before its line is drawn: a stage
	// shorter than that is never shown.
	After time.Duration
}

// Progress is the progress.Reporter for people. On a terminal each live
// stage is a line, redrawn in place ten times a second: a spinner, its
// name, the time it has run and its status or its bytes (done of total,
// at a rate); several stages are several lines. A log line clears them,
// prints, and they are drawn again below it. Every text it writes (names,
// statuses, log lines, from a guest or an artifact as often as not) goes
// through Printable or Line first.
type Progress struct {
	o     Options
	now   func() time.Time
	tick  time.Duration // between redraws; 0: none (the tests draw)
	width func() int    // the terminal's columns (0: unknown)

	mu      sync.Mutex
	stages  []*stage // live, in the order they started
	shown   int      // rows the live lines take on the terminal now
	frame   int      // the spinner's
	running bool     // the draw loop runs
	drew    bool     // a line was drawn once (Summary)
	sum     summary
}

// summary is what the ended stages moved, from the first stage's start to
// the last one's end.
type summary struct {
	first, last time.Time
	done, total int64
	bytes       bool
}

// New is a Progress that writes as o says.
func New(o Options) *Progress {
	p := &Progress{o: o, now: time.Now, tick: 100 * time.Millisecond, width: func() int { return 0 }}
	if f, ok := o.Term.(*os.File); ok {
		p.width = func() int {
			w, _, err := term.GetSize(int(f.Fd()))
			if err != nil {
				return 0
			}
			return w
		}
	}
	return p
}

// IfTerminal is w when it is a terminal (an *os.File that is one), else
// nil: Options.Term.
func IfTerminal(w io.Writer) io.Writer {
	if f, ok := w.(*os.File); ok && IsTerminal(f) {
		return f
	}
	return nil
}

// Log prints line above the live lines.
func (p *Progress) Log(line string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.clear()
	if p.o.Log != nil {
		io.WriteString(p.o.Log, Printable(p.o.Prefix+line)+"\n")
	}
	p.draw()
}

// Stage starts a line, drawn once the stage has run for Options.After.
func (p *Progress) Stage(name string) progress.Stage {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := &stage{p: p, name: Line(name), start: p.now(), total: -1}
	if p.sum.first.IsZero() {
		p.sum.first = s.start
	}
	p.stages = append(p.stages, s)
	if p.o.Term != nil && p.tick > 0 && !p.running {
		p.running = true
		go p.loop()
	}
	return s
}

// loop redraws the live lines until none is left.
func (p *Progress) loop() {
	t := time.NewTicker(p.tick)
	defer t.Stop()
	for p.redraw() {
		<-t.C
	}
}

// redraw draws the live lines with the spinner's next frame; false, and
// the loop is over, when none is left.
func (p *Progress) redraw() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.stages) == 0 {
		p.running = false
		return false
	}
	p.frame++
	p.draw()
	return true
}

// erase is what moves the cursor to the start of the first live line and
// erases them all (the row the cursor is on when none is drawn).
func (p *Progress) erase() string {
	up := ""
	if p.shown > 1 {
		up = fmt.Sprintf("\x1b[%dA", p.shown-1)
	}
	return up + "\r\x1b[J"
}

// clear erases the live lines, leaving the cursor where the first was.
func (p *Progress) clear() {
	if p.shown == 0 {
		return
	}
	io.WriteString(p.o.Term, p.erase())
	p.shown = 0
}

// draw writes the live lines that are due, in one write, over the ones
// drawn before.
func (p *Progress) draw() {
	if p.o.Term == nil {
		return
	}
	now, width := p.now(), p.width()
	var lines []string
	rows := 0
	for _, s := range p.stages {
		if now.Sub(s.start) >= p.o.After {
			l := s.line(now, p.frame)
			lines = append(lines, l)
			rows += wrapped(l, width)
		}
	}
	if p.shown == 0 && len(lines) == 0 {
		return
	}
	io.WriteString(p.o.Term, p.erase()+strings.Join(lines, "\n"))
	p.shown = rows
	p.drew = p.drew || len(lines) > 0
}

// wrapped is how many rows line takes on a terminal width columns wide
// (1 when the width is unknown): a line wider than the terminal wraps,
// and erase moves up over every row.
func wrapped(line string, width int) int {
	if width <= 0 {
		return 1
	}
	return max(1, (utf8.RuneCountInString(line)+width-1)/width)
}

// Summary prints, on a terminal and when a line was drawn, what the ended
// stages moved and how long they took: "copied 16 MB of 16 MB (100%) at
// 15 MB/s in 1.1s". Nothing otherwise: a short operation says nothing.
func (p *Progress) Summary(verb string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.o.Term == nil || !p.drew || !p.sum.bytes {
		return
	}
	p.clear()
	took := p.sum.last.Sub(p.sum.first)
	line := fmt.Sprintf("%s %s in %.1fs\n", verb, byteText(p.sum.done, p.sum.total, took), took.Seconds())
	io.WriteString(p.o.Term, Printable(line))
	p.draw()
}

// byteText is done of total (percent) at a rate over took; done alone
// when total is unknown (negative).
func byteText(done, total int64, took time.Duration) string {
	rate := ""
	if secs := took.Seconds(); secs > 0 {
		rate = fmt.Sprintf(" at %s/s", base.FormatSize(int64(float64(done)/secs)))
	}
	if total > 0 {
		done = min(done, total)
		return fmt.Sprintf("%s of %s (%d%%)%s", base.FormatSize(done), base.FormatSize(total), done*100/total, rate)
	}
	return base.FormatSize(done) + rate
}

// stage is one live line; its fields are under its Progress's lock.
type stage struct {
	p           *Progress
	name        string
	start       time.Time
	status      string
	bytes       bool // the last word was Bytes, not Status
	done, total int64
	told        bool // Status or Bytes was called
	ended       bool
}

func (s *stage) line(now time.Time, frame int) string {
	l := fmt.Sprintf("%c %s %.1fs", `|/-\`[frame%4], s.name, now.Sub(s.start).Seconds())
	switch {
	case s.bytes:
		return l + ": " + byteText(s.done, s.total, now.Sub(s.start))
	case s.status != "":
		return l + ": " + s.status
	}
	return l
}

// Status and Bytes change the stage's line for the next redraw; the
// first of them is drawn at once, so that a stage shorter than a redraw
// shows what it moves all the same.
func (s *stage) Status(v string) {
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	s.status, s.bytes = Line(v), false
	s.first()
}

func (s *stage) Bytes(done, total int64) {
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	s.done, s.total, s.bytes = done, total, true
	s.first()
}

func (s *stage) first() {
	if !s.told {
		s.told = true
		s.p.draw()
	}
}

// End removes the stage's line (the others are drawn again at once) and
// counts its bytes in the summary. Ending a stage twice does nothing.
func (s *stage) End() {
	p := s.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if s.ended {
		return
	}
	s.ended = true
	p.stages = slices.DeleteFunc(p.stages, func(x *stage) bool { return x == s })
	p.sum.last = p.now()
	if s.bytes {
		p.sum.done += s.done
		if s.total < 0 || p.sum.total < 0 {
			p.sum.total = -1
		} else {
			p.sum.total += s.total
		}
		p.sum.bytes = true
	}
	p.draw()
}
