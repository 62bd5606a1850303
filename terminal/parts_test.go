package terminal

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
)

func TestParts(t *testing.T) {
	var b bytes.Buffer
	p := NewParts(&b)
	p.Update("snapshot/memory", 0, 2<<20)
	p.Update("image/disk.qcow2", 0, 4<<20)
	p.drawn = p.drawn.AddDate(-1, 0, 0) // past the redraw limit
	p.Update("snapshot/memory", 1<<20, 2<<20)
	if s := b.String(); !strings.Contains(s, "snapshot/memory 50% of 2 MB") || !strings.Contains(s, "image/disk.qcow2 0% of 4 MB") {
		t.Fatalf("status line: %q", s)
	}
	b.Reset()
	fmt.Fprintf(p, "  snapshot/memory fetched and verified\n")
	if s := b.String(); !strings.HasPrefix(s, "\r\033[K  snapshot/memory fetched and verified\n") {
		t.Errorf("a log line does not clear the status line first: %q", s)
	}
	p.Update("snapshot/memory", 2<<20, 2<<20)
	p.Update("image/disk.qcow2", 4<<20, 4<<20)
	b.Reset()
	p.Done()
	if b.Len() != 0 && b.String() != "\r\033[K" {
		t.Errorf("done: %q", b.String())
	}
	if len(p.parts) != 0 {
		t.Errorf("complete parts still shown: %v", p.parts)
	}
}
