package qmp

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Transcript records every command a Client sends and QEMU's reply, a line
// each, so a failed snapshot or clone leaves more than an error string. A
// poll (query-migrate, query-jobs, ...) is recorded when the statuses in
// its reply differ from the last recorded one's, or a second after that
// one: its transitions and a trace of its progress (a live copy's counters
// change at every poll), not its thousands of repeats.
// The file is appended to and, past MaxBytes, renamed to Path+".1" (one old
// file kept). It is opened per entry, never following a link.
type Transcript struct {
	Path     string
	MaxBytes int64 // 0: 1 MiB

	mu   sync.Mutex
	last map[string]polled // poll command -> its last recorded reply
}

type polled struct {
	statuses string
	at       time.Time
}

// statusRE finds the statuses in a poll's reply.
var statusRE = regexp.MustCompile(`"status": ?"[^"]*"`)

// statuses is what tells a poll's replies apart: the statuses in it (all of
// it when it has none, an error).
func statuses(answer string) string {
	if m := statusRE.FindAllString(answer, -1); m != nil {
		return strings.Join(m, ",")
	}
	return answer
}

// polls are the commands kvbox repeats while it waits.
var polls = map[string]bool{
	"query-migrate": true, "query-jobs": true, "query-status": true, "query-block-jobs": true,
}

func (t *Transcript) record(command string, req, rep []byte, err error, took time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	answer := string(rep)
	if err != nil {
		answer = "error: " + err.Error()
	}
	if polls[command] {
		if t.last == nil {
			t.last = map[string]polled{}
		}
		p := polled{statuses(answer), time.Now()}
		if l, ok := t.last[command]; ok && l.statuses == p.statuses && p.at.Sub(l.at) < time.Second {
			return
		}
		t.last[command] = p
	}
	max := t.MaxBytes
	if max <= 0 {
		max = 1 << 20
	}
	if fi, err := os.Lstat(t.Path); err == nil && fi.Mode().IsRegular() && fi.Size() > max {
		os.Rename(t.Path, t.Path+".1")
	}
	f, err := os.OpenFile(t.Path, os.O_WRONLY|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return // a transcript never fails a command
	}
	defer f.Close()
	now := time.Now().UTC().Format("2006-01-02T15:04:05.000Z")
	fmt.Fprintf(f, "%s -> %s\n%s <- %s (%s)\n", now, req, now, answer, took.Round(time.Microsecond))
}
