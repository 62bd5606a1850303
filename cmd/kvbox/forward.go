package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/kvbox"
)

// openForwarder reaches the box's agent and makes its connection a stream
// carrier.
func (a *app) openForwarder(ctx context.Context, name string, before func(*agent.Client) error) (*domain.Host, *agent.Forwarder, error) {
	h, err := a.Host()
	if err != nil {
		return nil, nil, err
	}
	b, err := h.Get(name)
	if err != nil {
		return nil, nil, err
	}
	client, err := a.dial(ctx, h, b)
	if err != nil {
		return nil, nil, err
	}
	if before != nil {
		if err := before(client); err != nil {
			client.Close()
			return nil, nil, fmt.Errorf("box %q: %w", name, err)
		}
	}
	dctx, cancel := context.WithTimeout(ctx, a.dialTimeout)
	defer cancel()
	f, err := client.Forward(dctx)
	if err == nil {
		// A connection the guest never answers ends, and with it its
		// goroutine and socket (a port holder lives as long as the box).
		f.DialDeadline = a.dialTimeout
		// A snapshot of the box changes its agent token, which ends this
		// connection's rights: the forwarder presents the new one.
		f.Tokens = func() [][]byte { return domain.AgentTokens(b.Dir) }
	}
	if err != nil {
		client.Close()
		if errors.Is(err, agent.ErrNoForward) {
			return nil, nil, base.Errorf(base.Unavailable, "box %q: %v", name, err)
		}
		return nil, nil, fmt.Errorf("box %q: %w", name, err)
	}
	return h, f, nil
}

// serveForwards accepts on every listener and carries each connection to
// its guest port until ctx ends or the box's agent connection ends. A
// connection the guest refuses is closed and reported on one line.
func (a *app) serveForwards(ctx context.Context, name string, f *agent.Forwarder, specs []kvbox.Port, ls []*net.TCPListener) {
	var wg sync.WaitGroup
	var emu sync.Mutex
	for i, l := range ls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := l.AcceptTCP()
				if err != nil {
					return
				}
				go func() {
					if _, err := f.Connect(ctx, specs[i].GuestAddr(), c); err != nil {
						c.SetLinger(0)
						c.Close()
						if ctx.Err() == nil {
							emu.Lock()
							fmt.Fprintf(a.io.Err, "kvbox: %s -> %s:%d: %s\n", specs[i].ListenAddr(), name, specs[i].GuestPort, remoteMessage(err))
							emu.Unlock()
						}
					}
				}()
			}
		}()
	}
	select {
	case <-ctx.Done():
	case <-f.Done():
	}
	for _, l := range ls {
		l.Close()
	}
	wg.Wait()
}

func remoteMessage(err error) string {
	var re *agent.RemoteError
	if errors.As(err, &re) {
		return re.Message
	}
	return err.Error()
}

// boxGone says how a forward to name ended when the agent connection went
// away.
func (a *app) boxGone(h *domain.Host, name string, f *agent.Forwarder) error {
	why := f.Err()
	// The channel closes as QEMU ends, a moment before libvirt says so.
	// A removed box is stopped first, then undefined: a box seen stopped
	// is said stopped only if it is still there a second later.
	deadline := time.Now().Add(5 * time.Second)
	var stoppedAt time.Time
	var state domain.State
	for {
		b, err := h.Get(name)
		switch {
		case errors.Is(err, base.ErrNotFound):
			return fmt.Errorf("box %q was removed: port forwarding ended", name)
		case err == nil && b.State != domain.StateRunning:
			if stoppedAt.IsZero() {
				stoppedAt, state = time.Now(), b.State
			}
		}
		if !stoppedAt.IsZero() && time.Since(stoppedAt) > time.Second {
			return fmt.Errorf("box %q is %s: port forwarding ended", name, state)
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("box %q: the agent connection ended (%v): port forwarding ended", name, why)
}

func (a *app) newCmdPortForward() *cobra.Command {
	var listenFDs bool
	var readyFD int
	c := &cobra.Command{
		Use:   "port-forward NAME [ADDR:]HOSTPORT:GUESTPORT...",
		Short: "Forward host ports to ports in a box through its agent, until Ctrl-C",
		Long: `port-forward listens on each host port (127.0.0.1 unless an address is given)
and carries every connection to 127.0.0.1:GUESTPORT inside the box through the
box's agent channel: no network route to the box is needed. Many connections
run at once, each closed cleanly on either side. It ends on Ctrl-C, or when the
box stops or is removed. A host port of 0 picks a free one (printed).`,
		Example: `  kvbox port-forward dev 8080:8000
  kvbox port-forward dev 0.0.0.0:8080:8000 2222:22`,
		Args: func(c *cobra.Command, args []string) error {
			if len(args) < 2 {
				return usage("kvbox port-forward takes a box name and at least one [ADDR:]HOSTPORT:GUESTPORT")
			}
			return nil
		},
		RunE: func(c *cobra.Command, args []string) error {
			specs, err := kvbox.ParsePorts(args[1:])
			if err != nil {
				return err
			}
			var ls []*net.TCPListener
			if listenFDs {
				ls, err = kvbox.Inherited(specs)
			} else {
				ls, err = kvbox.Listen(specs)
			}
			if err != nil {
				return err
			}
			ctx := c.Context()
			h, f, err := a.openForwarder(ctx, args[0], nil)
			signalReady(readyFD, err)
			if err != nil {
				for _, l := range ls {
					l.Close()
				}
				return err
			}
			defer f.Close()
			for _, p := range specs {
				fmt.Fprintf(a.io.Out, "forwarding %s -> %s:%d\n", p.ListenAddr(), args[0], p.GuestPort)
			}
			a.serveForwards(ctx, args[0], f, specs, ls)
			if ctx.Err() != nil {
				return nil // Ctrl-C is how it is meant to end
			}
			return a.boxGone(h, args[0], f)
		},
	}
	c.Flags().BoolVar(&listenFDs, "listen-fds", false, "use listeners inherited as fds 3.. (one per port, for new --publish)")
	c.Flags().MarkHidden("listen-fds")
	c.Flags().IntVar(&readyFD, "ready-fd", 0, "write ok (or the error) on this fd once forwarding")
	c.Flags().MarkHidden("ready-fd")
	return c
}

// stdioConn is standard input and output as one connection, for ssh's
// ProxyCommand: the box's EOF closes stdout.
type stdioConn struct {
	in  io.Reader
	out io.Writer
}

func (s stdioConn) Read(b []byte) (int, error)  { return s.in.Read(b) }
func (s stdioConn) Write(b []byte) (int, error) { return s.out.Write(b) }
func (s stdioConn) CloseWrite() error {
	if c, ok := s.out.(io.Closer); ok {
		return c.Close()
	}
	return nil
}
func (s stdioConn) Close() error {
	s.CloseWrite()
	if c, ok := s.in.(io.Closer); ok {
		return c.Close()
	}
	return nil
}

func (a *app) newCmdSSHProxy() *cobra.Command {
	var port int
	var installKey bool
	c := &cobra.Command{
		Use:   "ssh-proxy NAME",
		Short: "Connect standard input and output to a box's SSH port through its agent (for ssh's ProxyCommand)",
		Example: `  ssh -o ProxyCommand='kvbox ssh-proxy %h' root@dev
  kvbox ssh-config >> ~/.ssh/config && ssh dev`,
		Args: exactArgs(1, "one box name"),
		RunE: func(c *cobra.Command, args []string) error {
			if port < 1 || port > 65535 {
				return usage("--port must be 1-65535")
			}
			ctx := c.Context()
			var before func(*agent.Client) error
			if installKey {
				pub, err := a.sshKey()
				if err != nil {
					return err
				}
				before = func(cl *agent.Client) error { return authorizeKey(ctx, cl, pub) }
			}
			h, f, err := a.openForwarder(ctx, args[0], before)
			if err != nil {
				return err
			}
			defer f.Close()
			ended, err := f.Connect(ctx, "127.0.0.1:"+strconv.Itoa(port), stdioConn{a.raw.In, a.raw.Out})
			if err != nil {
				return fmt.Errorf("box %q port %d: %s", args[0], port, remoteMessage(err))
			}
			select {
			case <-ended:
				return nil
			case <-ctx.Done():
				return nil
			case <-f.Done():
				return a.boxGone(h, args[0], f)
			}
		},
	}
	c.Flags().IntVar(&port, "port", 22, "the guest port to connect to")
	c.Flags().BoolVar(&installKey, "install-key", true, "first add kvbox's SSH key (STATE-DIR/ssh/id_ed25519.pub) to root's authorized_keys in the box, if it has sshd")
	return c
}

func (a *app) newCmdSSHConfig() *cobra.Command {
	var user string
	c := &cobra.Command{
		Use:   "ssh-config [NAME...]",
		Short: "Print ssh_config Host entries for boxes, reaching each through kvbox ssh-proxy",
		Long: `ssh-config prints a Host entry per box (every box, or the ones named) that
reaches it through 'kvbox ssh-proxy', so 'ssh NAME' and IDE remote-SSH work
without a route to the box. Each entry names the box's UUID as its
HostKeyAlias: a new box that reuses a name is a new host to ssh, not a
changed key.`,
		Example: "  kvbox ssh-config >> ~/.ssh/config\n  ssh dev",
		RunE: func(c *cobra.Command, args []string) error {
			boxes, err := a.boxes()
			if err != nil {
				return err
			}
			want := map[string]bool{}
			for _, n := range args {
				want[n] = true
			}
			self, err := os.Executable()
			if err != nil {
				self = "kvbox"
			}
			proxy := []string{self}
			if a.stateDir != "/var/lib/kvbox" {
				proxy = append(proxy, "--state-dir", a.stateDir)
			}
			if a.uri != domain.DefaultURI() {
				proxy = append(proxy, "--connect", a.uri)
			}
			found := 0
			for _, b := range boxes {
				if len(want) > 0 && !want[b.Name] {
					continue
				}
				found++
				delete(want, b.Name)
				fmt.Fprintf(a.io.Out, "Host %s\n  HostName %s\n  User %s\n  ProxyCommand %s ssh-proxy %%h\n  HostKeyAlias kvbox-%s\n  IdentityFile %s\n  IdentitiesOnly yes\n\n",
					b.Name, b.Name, user, strings.Join(proxy, " "), b.UUID, a.sshKeyPath())
			}
			for n := range want {
				h, err := a.Host()
				if err != nil {
					return err
				}
				_, err = h.Get(n)
				return err
			}
			return nil
		},
	}
	c.Flags().StringVarP(&user, "user", "u", "root", "the user ssh logs in as")
	return c
}

func (a *app) sshKeyPath() string { return filepath.Join(a.stateDir, "ssh", "id_ed25519") }

// sshKey returns kvbox's SSH public key, making the pair on first use.
func (a *app) sshKey() (string, error) {
	k := a.sshKeyPath()
	if _, err := os.Stat(k + ".pub"); err != nil {
		if err := os.MkdirAll(filepath.Dir(k), 0o700); err != nil {
			return "", err
		}
		out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvbox", "-f", k).CombinedOutput()
		if err != nil {
			return "", fmt.Errorf("make kvbox's SSH key %s: %v: %s", k, err, strings.TrimSpace(string(out)))
		}
	}
	b, err := os.ReadFile(k + ".pub")
	return strings.TrimSpace(string(b)), err
}

// authorizeKeyScript adds $1 to root's authorized_keys once, in a box with
// sshd.
const authorizeKeyScript = `[ -x /usr/sbin/sshd ] || exit 0
umask 077; mkdir -p /root/.ssh; touch /root/.ssh/authorized_keys
grep -qxF "$1" /root/.ssh/authorized_keys || printf '%s\n' "$1" >>/root/.ssh/authorized_keys`

func authorizeKey(ctx context.Context, c *agent.Client, pub string) error {
	var stderr strings.Builder
	code, err := c.Exec(ctx, agent.ExecRequest{Argv: []string{"/bin/sh", "-c", authorizeKeyScript, "sh", pub}}, nil, nil, &stderr, nil)
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d: %s", code, strings.TrimSpace(stderr.String()))
	}
	if err != nil {
		return fmt.Errorf("add kvbox's SSH key to root's authorized_keys: %w", err)
	}
	return nil
}
