package kvboxnode

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/virtual-kubelet/virtual-kubelet/node/api"
)

// A pod's command's output is kept on the host, one file per run, a line
// per record as the CRI logs them: time (RFC 3339, nanoseconds), stream,
// F for a whole line or P for a part of a longer one, the text.
//
//	2026-12-05T10:00:00.123456789Z stdout F hello
const (
	logFileName     = "current.log"
	previousLogName = "previous.log"
	// maxLogBytes is the most a run's log keeps: past it the older half
	// goes (rotated to rotatedLogName, replacing the one before).
	maxLogBytes    = 8 << 20
	rotatedLogName = "current.log.1"
	// maxLineBytes cuts a longer line into P records.
	maxLineBytes = 16 << 10
)

// logFile is the log of one run of a pod's command.
type logFile struct {
	dir string
	now func() time.Time

	mu   sync.Mutex
	f    *os.File
	size int64
}

// openLog opens the log of a new run in dir; the run before it, if any,
// becomes the previous one (kubectl logs --previous).
func openLog(dir string, now func() time.Time, rotatePrevious bool) (*logFile, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	cur := filepath.Join(dir, logFileName)
	if rotatePrevious {
		if _, err := os.Stat(cur); err == nil {
			if err := os.Rename(cur, filepath.Join(dir, previousLogName)); err != nil {
				return nil, err
			}
			os.Remove(filepath.Join(dir, rotatedLogName))
		}
	}
	f, err := os.OpenFile(cur, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &logFile{dir: dir, now: now, f: f, size: fi.Size()}, nil
}

func (l *logFile) record(stream string, partial bool, text []byte) {
	tag := "F"
	if partial {
		tag = "P"
	}
	line := fmt.Sprintf("%s %s %s %s\n", l.now().UTC().Format(time.RFC3339Nano), stream, tag, text)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return
	}
	if l.size+int64(len(line)) > maxLogBytes {
		// Keep the newer half: the file as it is becomes the rotated one.
		cur := filepath.Join(l.dir, logFileName)
		if err := os.Rename(cur, filepath.Join(l.dir, rotatedLogName)); err == nil {
			if f, err := os.OpenFile(cur, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600); err == nil {
				l.f.Close()
				l.f, l.size = f, 0
			}
		}
	}
	n, _ := l.f.WriteString(line)
	l.size += int64(n)
}

func (l *logFile) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// streamWriter cuts what a stream of the command writes into records.
type streamWriter struct {
	l      *logFile
	stream string
	buf    []byte
}

func (w *streamWriter) Write(b []byte) (int, error) {
	w.buf = append(w.buf, b...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.l.record(w.stream, false, w.buf[:i])
		w.buf = w.buf[i+1:]
	}
	for len(w.buf) >= maxLineBytes {
		w.l.record(w.stream, true, w.buf[:maxLineBytes])
		w.buf = w.buf[maxLineBytes:]
	}
	return len(b), nil
}

// flush writes what is left of a last line without its newline.
func (w *streamWriter) flush() {
	if len(w.buf) > 0 {
		w.l.record(w.stream, false, w.buf)
		w.buf = nil
	}
}

// logRecord is one line of a log file.
type logRecord struct {
	at      time.Time
	partial bool
	text    string
}

func parseRecord(line string) (logRecord, bool) {
	ts, rest, ok := strings.Cut(line, " ")
	if !ok {
		return logRecord{}, false
	}
	at, err := time.Parse(time.RFC3339Nano, ts)
	if err != nil {
		return logRecord{}, false
	}
	_, rest, ok = strings.Cut(rest, " ") // the stream
	if !ok {
		return logRecord{}, false
	}
	tag, text, ok := strings.Cut(rest, " ")
	if !ok {
		return logRecord{}, false
	}
	return logRecord{at: at, partial: tag == "P", text: text}, true
}

// readRecords reads the records of files in order (missing ones are
// empty), joined into whole lines.
func readRecords(files ...string) ([]logRecord, int64, error) {
	var out []logRecord
	var end int64
	var part strings.Builder
	for _, name := range files {
		f, err := os.Open(name)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, 0, err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 2*maxLineBytes)
		end = 0
		for sc.Scan() {
			end += int64(len(sc.Bytes())) + 1
			r, ok := parseRecord(sc.Text())
			if !ok {
				continue
			}
			part.WriteString(r.text)
			if r.partial {
				continue
			}
			out = append(out, logRecord{at: r.at, text: part.String()})
			part.Reset()
		}
		err = sc.Err()
		f.Close()
		if err != nil {
			return nil, 0, err
		}
	}
	return out, end, nil
}

// formatRecords is what kubectl logs prints of records under o: those since
// o.SinceTime/SinceSeconds, the last o.Tail, each with its time when asked.
func formatRecords(recs []logRecord, o api.ContainerLogOpts, now time.Time) []byte {
	since := o.SinceTime
	if o.SinceSeconds > 0 {
		since = now.Add(-time.Duration(o.SinceSeconds) * time.Second)
	}
	if !since.IsZero() {
		i := 0
		for i < len(recs) && recs[i].at.Before(since) {
			i++
		}
		recs = recs[i:]
	}
	if o.Tail > 0 && len(recs) > o.Tail {
		recs = recs[len(recs)-o.Tail:]
	}
	var b bytes.Buffer
	for _, r := range recs {
		if o.Timestamps {
			b.WriteString(r.at.UTC().Format(time.RFC3339Nano))
			b.WriteByte(' ')
		}
		b.WriteString(r.text)
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// tailLines is the last n lines of b (n <= 0: all of it).
func tailLines(b []byte, n int) []byte {
	if n <= 0 {
		return b
	}
	end := len(b)
	if end > 0 && b[end-1] == '\n' {
		end--
	}
	for i := end - 1; i >= 0; i-- {
		if b[i] == '\n' {
			n--
			if n == 0 {
				return b[i+1:]
			}
		}
	}
	return b
}

// limited cuts r at o.LimitBytes, when set.
func limited(r io.ReadCloser, o api.ContainerLogOpts) io.ReadCloser {
	if o.LimitBytes <= 0 {
		return r
	}
	return struct {
		io.Reader
		io.Closer
	}{io.LimitReader(r, int64(o.LimitBytes)), r}
}

// followFile streams what is appended to path after offset until ctx ends
// or done is closed (the writer finished) and nothing more came; each
// new whole record goes through emit.
func followFile(ctx context.Context, path string, offset int64, done <-chan struct{}, emit func(logRecord) error) error {
	var part strings.Builder
	var pending []byte
	for {
		finished := false
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-done:
			finished = true
		case <-time.After(250 * time.Millisecond):
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		fi, err := f.Stat()
		if err == nil && fi.Size() < offset {
			offset = 0 // rotated
		}
		if _, err := f.Seek(offset, io.SeekStart); err != nil {
			f.Close()
			return err
		}
		b, err := io.ReadAll(f)
		f.Close()
		if err != nil {
			return err
		}
		offset += int64(len(b))
		pending = append(pending, b...)
		for {
			i := bytes.IndexByte(pending, '\n')
			if i < 0 {
				break
			}
			r, ok := parseRecord(string(pending[:i]))
			pending = pending[i+1:]
			if !ok {
				continue
			}
			part.WriteString(r.text)
			if r.partial {
				continue
			}
			if err := emit(logRecord{at: r.at, text: part.String()}); err != nil {
				return err
			}
			part.Reset()
		}
		if finished {
			return nil
		}
	}
}
