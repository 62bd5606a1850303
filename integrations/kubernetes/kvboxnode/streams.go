package kvboxnode

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	utilexec "k8s.io/utils/exec"

	agent "kvbox.dev/kvbox/guest-agent"
)

// running is the pod's box if the pod runs one, for the kubelet API.
func (p *Provider) running(namespace, name, container string) (*podState, string, error) {
	ps := p.get(namespace, name)
	if ps == nil {
		return nil, "", errdefs.NotFoundf("pod %s/%s is not on this node", namespace, name)
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if c := ps.pod.Spec.Containers[0].Name; container != "" && container != c {
		return nil, "", errdefs.NotFoundf("pod %s/%s has no container %q (its one container is %s)", namespace, name, container, c)
	}
	if ps.box == "" || !ps.boxUp {
		return ps, "", errdefs.InvalidInputf("pod %s/%s has no running box (%s)", namespace, name, ps.phase)
	}
	return ps, ps.box, nil
}

// GetContainerLogs is kubectl logs: the output of the pod's command (its
// previous run's with --previous), or, for a pod without a command, what
// its box's console printed.
func (p *Provider) GetContainerLogs(ctx context.Context, namespace, name, container string, o api.ContainerLogOpts) (io.ReadCloser, error) {
	ps := p.get(namespace, name)
	if ps == nil {
		return nil, errdefs.NotFoundf("pod %s/%s is not on this node", namespace, name)
	}
	ps.mu.Lock()
	c := ps.pod.Spec.Containers[0]
	box, dir, done, up := ps.box, ps.logDir, ps.logDone, ps.boxUp
	ps.mu.Unlock()
	if container != "" && container != c.Name {
		return nil, errdefs.NotFoundf("pod %s/%s has no container %q (its one container is %s)", namespace, name, container, c.Name)
	}
	if len(c.Command) == 0 {
		if box == "" || !up {
			return nil, errdefs.InvalidInputf("pod %s/%s has no running box yet: no console to show", namespace, name)
		}
		return p.consoleLogs(ctx, box, o)
	}
	if o.Previous {
		recs, _, err := readRecords(filepath.Join(dir, previousLogName))
		if err != nil {
			return nil, err
		}
		return limited(io.NopCloser(bytes.NewReader(formatRecords(recs, o, p.now()))), o), nil
	}
	recs, end, err := readRecords(filepath.Join(dir, rotatedLogName), filepath.Join(dir, logFileName))
	if err != nil {
		return nil, err
	}
	first := formatRecords(recs, o, p.now())
	if !o.Follow {
		return limited(io.NopCloser(bytes.NewReader(first)), o), nil
	}
	pr, pw := io.Pipe()
	go func() {
		if _, err := pw.Write(first); err != nil {
			return
		}
		err := followFile(ctx, filepath.Join(dir, logFileName), end, done, func(r logRecord) error {
			_, err := pw.Write(formatRecords([]logRecord{r}, api.ContainerLogOpts{Timestamps: o.Timestamps}, p.now()))
			return err
		})
		pw.CloseWithError(err)
	}()
	return limited(pr, o), nil
}

// consoleLogs is the box's console log; it has no times, so --since and
// --timestamps do not apply to it. Followed (-f), the log is read once
// from its start and then on from where the last read ended: what the
// console prints later is read once, never the whole file again.
func (p *Provider) consoleLogs(ctx context.Context, box string, o api.ContainerLogOpts) (io.ReadCloser, error) {
	r, err := p.lib.ConsoleLog(box)
	if err != nil {
		return nil, err
	}
	b, err := io.ReadAll(r)
	if err != nil {
		r.Close()
		return nil, err
	}
	b = tailLines(b, o.Tail)
	if !o.Follow {
		r.Close()
		return limited(io.NopCloser(bytes.NewReader(b)), o), nil
	}
	pr, pw := io.Pipe()
	go func() {
		defer r.Close()
		if _, err := pw.Write(b); err != nil {
			return
		}
		pw.CloseWithError(followConsole(ctx, r, pw))
	}()
	return limited(pr, o), nil
}

// followConsole copies what is appended to the console log r (read to its
// end already) to w until ctx ends, looking every half second. A log cut
// shorter than what was read (the console started again) is read from its
// start.
func followConsole(ctx context.Context, r io.Reader, w io.Writer) error {
	f, _ := r.(interface {
		Stat() (os.FileInfo, error)
		Seek(int64, int) (int64, error)
	})
	buf := make([]byte, 32<<10)
	for sleep(ctx, 500*time.Millisecond) {
		if f != nil {
			if at, err := f.Seek(0, io.SeekCurrent); err == nil {
				if fi, err := f.Stat(); err == nil && fi.Size() < at {
					f.Seek(0, io.SeekStart)
				}
			}
		}
		for {
			n, err := r.Read(buf)
			if n > 0 {
				if _, werr := w.Write(buf[:n]); werr != nil {
					return werr
				}
			}
			if err == io.EOF || n == 0 && err == nil {
				break
			}
			if err != nil {
				return err
			}
		}
	}
	return ctx.Err()
}

// RunInContainer is kubectl exec: cmd runs in the pod's box through its
// agent with the container's environment, user and folder, on a terminal
// when asked (resizes passed on), stdin forwarded; its exit code is the
// exec's.
func (p *Provider) RunInContainer(ctx context.Context, namespace, name, container string, cmd []string, attach api.AttachIO) error {
	ps, box, err := p.running(namespace, name, container)
	if err != nil {
		return err
	}
	if len(cmd) == 0 {
		return errdefs.InvalidInput("give a command to run")
	}
	ps.mu.Lock()
	pod := ps.pod.DeepCopy()
	env := ps.env
	ps.mu.Unlock()
	req := execRequest(pod, env, cmd)
	req.TTY = attach.TTY()
	if req.TTY {
		req.EnvAdd = append([]string{"TERM=xterm-256color"}, req.EnvAdd...)
	}
	var resize chan agent.WinSize
	if ch := attach.Resize(); ch != nil {
		resize = make(chan agent.WinSize, 1)
		go func() {
			for {
				select {
				case <-ctx.Done():
					return
				case s, ok := <-ch:
					if !ok {
						return
					}
					select {
					case resize <- agent.WinSize{Rows: s.Height, Cols: s.Width}:
					case <-ctx.Done():
						return
					}
				}
			}
		}()
	}
	var stdout, stderr io.Writer = io.Discard, io.Discard
	if w := attach.Stdout(); w != nil {
		stdout = w
	}
	if w := attach.Stderr(); w != nil {
		stderr = w
	}
	code, err := p.lib.Exec(ctx, box, req, attach.Stdin(), stdout, stderr, resize)
	var re *agent.RemoteError
	if errors.As(err, &re) {
		// Could not be started: as a shell says it, and its code.
		fmt.Fprintf(stderr, "kvbox: %s: %s\n", cmd[0], re.Message)
		return utilexec.CodeExitError{Err: errors.New(re.Message), Code: 127}
	}
	if err != nil {
		return err
	}
	if code != 0 {
		return utilexec.CodeExitError{Err: fmt.Errorf("command terminated with exit code %d", code), Code: code}
	}
	return nil
}

// AttachToContainer is kubectl attach, which kvbox pods do not offer (they
// have no stdin or tty; kubectl exec reaches them).
func (p *Provider) AttachToContainer(ctx context.Context, namespace, name, container string, attach api.AttachIO) error {
	return errdefs.InvalidInputf("pod %s/%s: kvbox pods have no stdin to attach to: use kubectl exec", namespace, name)
}

// PortForward is kubectl port-forward: one stream to port inside the box,
// through its agent.
func (p *Provider) PortForward(ctx context.Context, namespace, name string, port int32, stream io.ReadWriteCloser) error {
	_, box, err := p.running(namespace, name, "")
	if err != nil {
		return err
	}
	conn, err := p.lib.Dial(ctx, box, "127.0.0.1:"+strconv.Itoa(int(port)))
	if err != nil {
		return fmt.Errorf("pod %s/%s: port %d: %w", namespace, name, port, err)
	}
	defer conn.Close()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		io.Copy(conn, stream)
		if cw, ok := conn.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite()
		}
	}()
	_, err = io.Copy(stream, conn)
	stream.Close()
	conn.Close()
	wg.Wait()
	if errors.Is(err, io.EOF) || errors.Is(err, context.Canceled) {
		err = nil
	}
	return err
}
