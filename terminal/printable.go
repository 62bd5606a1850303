// Package terminal is how kvbox writes for people on a terminal: text made
// printable on its way (Printable, Line, Writer), and the live lines of
// what runs a while (Progress, the one progress.Reporter for people: a
// line a stage), drawn only on a terminal.
//
// Strings that did not come from this host reach kvbox's output all the
// time: a guest's file names and messages, an after-clone hook's output, an agent's error, the fields of a pulled snapshot, a
// registry's error text. Any of them may hold an escape sequence (which a
// terminal obeys: retitle the window, rewrite what is on screen, answer
// back into the shell's input), a bidi override (which shows text in
// another order than it is), or bytes that are not UTF-8. So the command's
// standard output and error are Writers (the CLI wraps them): whatever a
// command prints goes through Printable on the way, and no print can
// forget to. Raw, by design: the bytes of exec, connect, ssh-proxy and
// `cp BOX:SRC -`, and the cursor controls of the status lines here, whose
// text goes through Printable before they are drawn raw.
//
// The escapes Printable writes are JSON's (\u001b, a surrogate pair beyond
// the BMP), so the output of --json stays exact JSON: a JSON string can
// hold such a character only raw, and its escape decodes to the same
// string. Invalid UTF-8 is written as \xNN (encoding/json never writes it).
package terminal

import (
	"fmt"
	"io"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// unprintable reports whether r must not reach a terminal as it is: control
// characters (C0 but newline and tab, DEL, C1: escape sequences start with
// ESC or CSI), format characters (bidi overrides and isolates, zero-width
// ones), line and paragraph separators, private use and surrogates: all
// that unicode.IsGraphic refuses.
func unprintable(r rune) bool {
	return r != '\n' && r != '\t' && !unicode.IsGraphic(r)
}

// Printable is s with every unprintable rune written as a JSON escape and
// every byte that is not UTF-8 as \xNN; s itself when it has neither.
func Printable(s string) string { return escape(s, unprintable) }

// Line is Printable that escapes newlines and tabs too: one cell of a
// table, one field of a line.
func Line(s string) string {
	return escape(s, func(r rune) bool { return r == '\n' || r == '\t' || unprintable(r) })
}

func escape(s string, bad func(rune) bool) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || bad(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case bad(r) && r > 0xffff:
			hi, lo := utf16.EncodeRune(r)
			fmt.Fprintf(&b, `\u%04x\u%04x`, hi, lo)
		case bad(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// Writer passes what is written to W through Printable. Each Write is
// taken as whole text (kvbox writes whole strings: fmt, encoding/json,
// text/tabwriter): a rune split across two Writes is written as \xNN.
type Writer struct{ W io.Writer }

func (p Writer) Write(b []byte) (int, error) {
	s := Printable(string(b))
	if _, err := io.WriteString(p.W, s); err != nil {
		return 0, err
	}
	return len(b), nil
}
