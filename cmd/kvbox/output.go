package main

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"text/tabwriter"
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

// table starts a table for people with the given column headers; write
// rows with tabs between cells and Flush it.
func (a *app) table(cols ...string) *tabwriter.Writer {
	w := tabwriter.NewWriter(a.io.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, strings.Join(cols, "\t"))
	return w
}
