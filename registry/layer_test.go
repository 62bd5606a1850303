package registry

import (
	"io"
	"strings"
	"testing"

	"kvbox.dev/kvbox/progress"
)

// stages records what a progress reader reports.
type stages struct{ events []string }

func (r *stages) Log(string) {}
func (r *stages) Stage(name string) progress.Stage {
	r.events = append(r.events, "stage "+name)
	return stageOf{r}
}

type stageOf struct{ r *stages }

func (s stageOf) Status(string)           {}
func (s stageOf) Bytes(done, total int64) { s.r.events = append(s.r.events, "bytes") }
func (s stageOf) End()                    { s.r.events = append(s.r.events, "end") }

func TestProgressReader(t *testing.T) {
	for _, tc := range []struct {
		name string
		read int
		want string
	}{
		{"read whole", 4, "stage image/vmlinuz bytes bytes end"},
		{"closed early", 1, "stage image/vmlinuz bytes bytes end"},
	} {
		var r stages
		rc := progressReader(io.NopCloser(strings.NewReader("abcd")), "image/vmlinuz", 4, &r)
		if _, err := io.ReadFull(rc, make([]byte, tc.read)); err != nil {
			t.Fatal(err)
		}
		rc.Close()
		rc.Close()
		if got := strings.Join(r.events, " "); got != tc.want {
			t.Errorf("%s: reported %q, want %q", tc.name, got, tc.want)
		}
	}
	if rc := io.NopCloser(strings.NewReader("")); progressReader(rc, "t", 0, nil) != rc {
		t.Error("no reporter: the reader is not rc itself")
	}
}
