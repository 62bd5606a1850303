package main

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"text/tabwriter"

	"kvbox.dev/kvbox/progress"
	"kvbox.dev/kvbox/terminal"
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

// row adds a row; each cell is one printable line (terminal.Line): a cell
// a pulled snapshot names cannot start a row or a column of its own.
func (t *table) row(cells ...any) {
	s := make([]string, len(cells))
	for i, c := range cells {
		s[i] = terminal.Line(fmt.Sprint(c))
	}
	fmt.Fprintln(t.w, strings.Join(s, "\t"))
}

func (t *table) Flush() error { return t.w.Flush() }

// spin shows what kvbox is waiting for, with a spinner and the time spent,
// on a terminal only; stop clears the line.
func (a *app) spin(what string) (stop func()) {
	return a.reporter().Stage(what).End
}

// reporter is the terminal's progress.Reporter: each stage is a line
// while it runs, drawn when stderr is a terminal (raw, for the lines'
// cursor controls: their text is made printable), a log line goes to
// stderr.
func (a *app) reporter() progress.Reporter {
	return terminal.New(terminal.Options{Term: terminal.IfTerminal(a.raw.Err), Log: a.io.Err})
}
