package terminal

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// screen is a fake terminal: it keeps what a real one would show of what
// is written to it, for the few controls Progress writes (carriage
// return, newline, cursor up, erase to the end of the screen or line).
// Any other escape fails the test.
type screen struct {
	t     *testing.T
	width int // columns; a longer line wraps (0: no end)
	raw   bytes.Buffer
	rows  [][]rune
	r, c  int
}

func (s *screen) Write(b []byte) (int, error) {
	s.raw.Write(b)
	in := []rune(string(b))
	for i := 0; i < len(in); i++ {
		switch ch := in[i]; ch {
		case '\r':
			s.c = 0
		case '\n':
			s.r, s.c = s.r+1, 0
		case 0x1b:
			j := i + 2
			for j < len(in) && in[j] >= '0' && in[j] <= '9' {
				j++
			}
			if i+1 >= len(in) || in[i+1] != '[' || j >= len(in) {
				s.t.Fatalf("an escape that is not a cursor control: %q", b)
			}
			n := 1
			fmt.Sscan(string(in[i+2:j]), &n)
			s.control(in[j], n)
			i = j
		default:
			s.put(ch)
		}
	}
	return len(b), nil
}

func (s *screen) control(final rune, n int) {
	s.grow()
	switch final {
	case 'A':
		s.r = max(0, s.r-n)
	case 'J':
		s.rows[s.r] = s.rows[s.r][:min(s.c, len(s.rows[s.r]))]
		s.rows = s.rows[:s.r+1]
	case 'K':
		s.rows[s.r] = s.rows[s.r][:min(s.c, len(s.rows[s.r]))]
	default:
		s.t.Fatalf("an escape that is not a cursor control: ESC [ %d %c", n, final)
	}
}

func (s *screen) grow() {
	for len(s.rows) <= s.r {
		s.rows = append(s.rows, nil)
	}
}

func (s *screen) put(ch rune) {
	if s.width > 0 && s.c >= s.width {
		s.r, s.c = s.r+1, 0
	}
	s.grow()
	for len(s.rows[s.r]) < s.c {
		s.rows[s.r] = append(s.rows[s.r], ' ')
	}
	if s.c < len(s.rows[s.r]) {
		s.rows[s.r][s.c] = ch
	} else {
		s.rows[s.r] = append(s.rows[s.r], ch)
	}
	s.c++
}

// text is the screen's rows, empty ones at the end left out.
func (s *screen) text() []string {
	var out []string
	for _, r := range s.rows {
		out = append(out, string(r))
	}
	for len(out) > 0 && out[len(out)-1] == "" {
		out = out[:len(out)-1]
	}
	return out
}

func (s *screen) want(what string, rows ...string) {
	s.t.Helper()
	if got := s.text(); strings.Join(got, "\n") != strings.Join(rows, "\n") {
		s.t.Fatalf("%s: the screen shows\n%q\nwant\n%q\n(written: %q)", what, got, rows, s.raw.String())
	}
}

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

// newTest is a Progress on a fake terminal that is also its log (as
// stderr is both), with a clock that moves only when the test says, and
// no draw loop: the test draws (redraw, as the loop does).
func newTest(t *testing.T, o Options) (*Progress, *screen, *clock) {
	s := &screen{t: t}
	o.Term, o.Log = s, s
	p := New(o)
	c := &clock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	p.now, p.tick = c.now, 0
	return p, s, c
}

func TestStageLine(t *testing.T) {
	p, s, c := newTest(t, Options{})
	st := p.Stage("booting dev")
	c.t = c.t.Add(1500 * time.Millisecond)
	p.redraw()
	s.want("a new stage", "/ booting dev 1.5s")
	st.Status("waiting for its agent")
	c.t = c.t.Add(time.Second)
	p.redraw()
	s.want("a status", "- booting dev 2.5s: waiting for its agent")
	st.End()
	s.want("an ended stage")
	if p.redraw() {
		t.Error("the draw loop goes on with no stage left")
	}
}

func TestStageBytes(t *testing.T) {
	p, s, c := newTest(t, Options{})
	st := p.Stage("snapshot/memory")
	st.Bytes(1<<20, 4<<20)
	c.t = c.t.Add(2 * time.Second)
	p.redraw()
	s.want("bytes of a total", "/ snapshot/memory 2.0s: 1 MB of 4 MB (25%) at 512 KB/s")
	st.Bytes(3<<20, -1)
	p.redraw()
	s.want("bytes of no known total", "- snapshot/memory 2.0s: 3 MB at 1.5 MB/s")
	st.Status("verifying")
	p.redraw()
	s.want("a status after bytes", `\ snapshot/memory 2.0s: verifying`)
}

func TestSeveralStages(t *testing.T) {
	p, s, c := newTest(t, Options{})
	mem := p.Stage("snapshot/memory")
	disk := p.Stage("snapshot/disk.qcow2")
	mem.Bytes(0, 2<<20)
	disk.Bytes(0, 4<<20)
	c.t = c.t.Add(time.Second)
	p.redraw()
	s.want("two parts", "/ snapshot/memory 1.0s: 0 B of 2 MB (0%) at 0 B/s", "/ snapshot/disk.qcow2 1.0s: 0 B of 4 MB (0%) at 0 B/s")
	mem.Bytes(1<<20, 2<<20)
	disk.Bytes(2<<20, 4<<20)
	p.redraw()
	s.want("two parts redrawn", "- snapshot/memory 1.0s: 1 MB of 2 MB (50%) at 1 MB/s", "- snapshot/disk.qcow2 1.0s: 2 MB of 4 MB (50%) at 2 MB/s")
	third := p.Stage("image/disk.qcow2")
	p.redraw()
	s.want("a third part", `\ snapshot/memory 1.0s: 1 MB of 2 MB (50%) at 1 MB/s`, `\ snapshot/disk.qcow2 1.0s: 2 MB of 4 MB (50%) at 2 MB/s`, `\ image/disk.qcow2 0.0s`)
	mem.End()
	s.want("the first part over", `\ snapshot/disk.qcow2 1.0s: 2 MB of 4 MB (50%) at 2 MB/s`, `\ image/disk.qcow2 0.0s`)
	disk.End()
	third.End()
	s.want("all parts over")
}

func TestLogAboveLiveLines(t *testing.T) {
	p, s, c := newTest(t, Options{Prefix: "kvbox: cp: "})
	a, b := p.Stage("snapshot/memory"), p.Stage("snapshot/state")
	c.t = c.t.Add(time.Second)
	p.redraw()
	p.Log("skipped /srv/link")
	s.want("a log line", "kvbox: cp: skipped /srv/link", "/ snapshot/memory 1.0s", "/ snapshot/state 1.0s")
	a.End()
	p.Log("second")
	s.want("a second log line", "kvbox: cp: skipped /srv/link", "kvbox: cp: second", "/ snapshot/state 1.0s")
	b.End()
	s.want("all over", "kvbox: cp: skipped /srv/link", "kvbox: cp: second")
}

// TestNotATerminal: with no terminal, log lines are written as they are
// and nothing else is.
func TestNotATerminal(t *testing.T) {
	var log bytes.Buffer
	p := New(Options{Log: &log, Prefix: "kvbox: cp: "})
	st := p.Stage("copy")
	st.Bytes(1, 2)
	p.Log("a line")
	p.redraw()
	st.End()
	p.Summary("copied")
	if log.String() != "kvbox: cp: a line\n" {
		t.Errorf("written: %q", log.String())
	}
}

func TestAfter(t *testing.T) {
	p, s, c := newTest(t, Options{After: time.Second})
	short := p.Stage("copy")
	short.Bytes(1<<20, 1<<20)
	c.t = c.t.Add(999 * time.Millisecond)
	p.redraw()
	short.End()
	p.Summary("copied")
	if s.raw.Len() != 0 {
		t.Fatalf("a stage shorter than After is drawn: %q", s.raw.String())
	}
	p, s, c = newTest(t, Options{After: time.Second})
	long := p.Stage("copy")
	long.Bytes(1<<20, 16<<20)
	c.t = c.t.Add(500 * time.Millisecond)
	p.redraw()
	if s.raw.Len() != 0 {
		t.Fatalf("a stage is drawn before After: %q", s.raw.String())
	}
	c.t = c.t.Add(500 * time.Millisecond)
	p.redraw()
	s.want("a stage past After", `- copy 1.0s: 1 MB of 16 MB (6%) at 1 MB/s`)
	long.Bytes(16<<20, 16<<20)
	c.t = c.t.Add(time.Second)
	long.End()
	p.Summary("copied")
	s.want("the summary", "copied 16 MB of 16 MB (100%) at 8 MB/s in 2.0s")
}

func TestUnprintable(t *testing.T) {
	p, s, c := newTest(t, Options{})
	st := p.Stage("snapshot/\x1b]0;pwned\x07memory\u202e")
	st.Status("line\nbreak \u009b31m")
	c.t = c.t.Add(time.Second)
	p.redraw()
	p.Log("a note \x1b[2J")
	s.want("unprintable text", `a note \u001b[2J`, `/ snapshot/\u001b]0;pwned\u0007memory\u202e 1.0s: line\u000abreak \u009b31m`)
	if raw := s.raw.String(); strings.ContainsAny(raw, "\x07\u202e\x9b") || strings.Contains(raw, "\x1b]") || strings.Contains(raw, "\x1b[2J") {
		t.Errorf("unprintable text reached the terminal: %q", raw)
	}
}

// TestWrap: lines wider than the terminal wrap, and are erased whole.
func TestWrap(t *testing.T) {
	p, s, c := newTest(t, Options{})
	s.width = 12
	p.width = func() int { return s.width }
	long := p.Stage("a long stage name")
	p.Stage("another")
	c.t = c.t.Add(time.Second)
	p.redraw()
	s.want("lines wider than the terminal", "/ a long sta", "ge name 1.0s", "/ another 1.", "0s")
	p.Log("a log line")
	s.want("a log line above them", "a log line", "/ a long sta", "ge name 1.0s", "/ another 1.", "0s")
	long.End()
	s.want("the long one over", "a log line", "/ another 1.", "0s")
}

// TestConcurrent: stages started, moved, logged about and ended from
// several goroutines at once, with the draw loop running, leave the log
// lines and nothing else (go test -race checks the locking).
func TestConcurrent(t *testing.T) {
	s := &screen{t: t}
	p := New(Options{Term: s, Log: s})
	p.tick = time.Millisecond
	done := make(chan struct{})
	var want []string
	for i := range 8 {
		want = append(want, fmt.Sprintf("part %d done", i))
		go func() {
			st := p.Stage(fmt.Sprintf("part %d", i))
			// Moved until the loop has drawn it twice, so that draws
			// and moves overlap.
			p.mu.Lock()
			from := p.frame
			p.mu.Unlock()
			for n := int64(0); ; n++ {
				st.Bytes(n, 1<<30)
				p.mu.Lock()
				drawn := p.frame >= from+2
				p.mu.Unlock()
				if drawn {
					break
				}
			}
			p.Log(fmt.Sprintf("part %d done", i))
			st.End()
			done <- struct{}{}
		}()
	}
	for range 8 {
		<-done
	}
	p.mu.Lock()
	got := s.text()
	p.mu.Unlock()
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("the screen shows %q, want the log lines %q", got, want)
	}
}

// TestFirstWordAtOnce: a stage's first status or bytes are drawn at once,
// what follows at the next redraw.
func TestFirstWordAtOnce(t *testing.T) {
	p, s, c := newTest(t, Options{})
	st := p.Stage("snapshot/state")
	st.Bytes(0, 2<<20)
	s.want("the first bytes", "| snapshot/state 0.0s: 0 B of 2 MB (0%)")
	c.t = c.t.Add(time.Second)
	st.Bytes(1<<20, 2<<20)
	s.want("the next bytes, before a redraw", "| snapshot/state 0.0s: 0 B of 2 MB (0%)")
	p.redraw()
	s.want("the next bytes", "/ snapshot/state 1.0s: 1 MB of 2 MB (50%) at 1 MB/s")
}
