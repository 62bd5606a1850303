package main

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/progress"
)

// printJSON writes v for programs: indented JSON, a nil slice as [].
func (a *app) printJSON(v any) error {
	if rv := reflect.ValueOf(v); rv.Kind() == reflect.Slice && rv.IsNil() {
		v = []any{}
	}
	e := json.NewEncoder(a.io.Out)
	e.SetIndent("", "  ")
	return e.Encode(v)
}

// table is a table for people: add rows, then Flush it.
type table struct{ w *tabwriter.Writer }

// table starts a table with the given column headers.
func (a *app) table(cols ...string) *table {
	w := tabwriter.NewWriter(a.io.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, strings.Join(cols, "\t"))
	return &table{w}
}

// row adds a row; each cell is one printable line (printableLine): a cell
// a pulled snapshot names cannot start a row or a column of its own.
func (t *table) row(cells ...any) {
	s := make([]string, len(cells))
	for i, c := range cells {
		s[i] = printableLine(fmt.Sprint(c))
	}
	fmt.Fprintln(t.w, strings.Join(s, "\t"))
}

func (t *table) Flush() error { return t.w.Flush() }

// spin shows what kvbox is waiting for, with a spinner and the time spent,
// on a terminal only; stop clears the line.
func (a *app) spin(what string) (stop func()) {
	_, stop = a.spinStatus(what)
	return stop
}

// spinStatus is spin with a status that set changes while it runs (the
// progress of a copy).
func (a *app) spinStatus(what string) (set func(status string), stop func()) {
	if !a.io.TTY {
		return func(string) {}, func() {}
	}
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
			fmt.Fprintf(a.raw.Err, "\r%c %s %.1fs%s\x1b[K", `|/-\`[i%4], printable(what), time.Since(start).Seconds(), printable(st))
			select {
			case <-done:
				fmt.Fprint(a.raw.Err, "\r\x1b[K")
				return
			case <-t.C:
			}
		}
	}()
	return set, func() { close(done); <-finished }
}

// reporter is the terminal's progress.Reporter: each stage is a spinner
// line (spinStatus) while it runs, a log line goes to stderr.
func (a *app) reporter() progress.Reporter { return spinReporter{a} }

type spinReporter struct{ a *app }

func (r spinReporter) Log(line string) { fmt.Fprintln(r.a.io.Err, line) }

func (r spinReporter) Stage(name string) progress.Stage {
	set, stop := r.a.spinStatus(name)
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
