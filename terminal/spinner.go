package terminal

import (
	"fmt"
	"io"
	"sync"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/progress"
)

// Spin shows on the terminal w what a command waits for, with a spinner,
// the time spent and a status that set changes while it runs; stop clears
// the line.
func Spin(w io.Writer, what string) (set func(status string), stop func()) {
	var mu sync.Mutex
	status := ""
	set = func(s string) {
		mu.Lock()
		status = s
		mu.Unlock()
	}
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		start := time.Now()
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for i := 0; ; i++ {
			mu.Lock()
			st := status
			mu.Unlock()
			if st != "" {
				st = ": " + st
			}
			fmt.Fprintf(w, "\r%c %s %.1fs%s\x1b[K", `|/-\`[i%4], Printable(what), time.Since(start).Seconds(), Printable(st))
			select {
			case <-done:
				fmt.Fprint(w, "\r\x1b[K")
				return
			case <-t.C:
			}
		}
	}()
	return set, func() { close(done); <-finished }
}

// Reporter is a progress.Reporter for people: each stage is a spinner line
// (Spin) on W while it runs, when TTY says W is a terminal; a log line
// goes to Lines.
type Reporter struct {
	W     io.Writer
	TTY   bool
	Lines io.Writer
}

func (r Reporter) Log(line string) { fmt.Fprintln(r.Lines, line) }

func (r Reporter) Stage(name string) progress.Stage {
	if !r.TTY {
		return spinStage{set: func(string) {}, stop: func() {}}
	}
	set, stop := Spin(r.W, name)
	return spinStage{set: set, stop: stop}
}

type spinStage struct {
	set  func(string)
	stop func()
}

func (s spinStage) Status(v string) { s.set(v) }

func (s spinStage) Bytes(done, total int64) {
	if total < 0 {
		s.set(base.FormatSize(done))
		return
	}
	s.set(base.FormatSize(done) + " of " + base.FormatSize(total))
}

func (s spinStage) End() { s.stop() }
