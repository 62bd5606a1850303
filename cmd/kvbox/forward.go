package main

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/statedir"
)

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
			k, err := a.lib()
			if err != nil {
				kvbox.SignalReady(readyFD, err)
				closeAll(ls)
				return err
			}
			var mu sync.Mutex
			ready := func(err error) {
				kvbox.SignalReady(readyFD, err)
				if err != nil {
					return
				}
				for _, p := range specs {
					fmt.Fprintf(a.io.Out, "forwarding %s -> %s:%d\n", p.ListenAddr(), args[0], p.GuestPort)
				}
			}
			refused := func(p kvbox.Port, err error) {
				mu.Lock()
				defer mu.Unlock()
				fmt.Fprintf(a.io.Err, "kvbox: %s -> %s:%d: %s\n", p.ListenAddr(), args[0], p.GuestPort, kvbox.RemoteMessage(err))
			}
			// Ctrl-C is how it is meant to end: ServePorts returns nil then.
			return k.ServePorts(c.Context(), args[0], specs, ls, ready, refused)
		},
	}
	c.Flags().BoolVar(&listenFDs, "listen-fds", false, "use listeners inherited as fds 3.. (one per port, for new --publish)")
	c.Flags().MarkHidden("listen-fds")
	c.Flags().IntVar(&readyFD, "ready-fd", 0, "write ok (or the error) on this fd once forwarding")
	c.Flags().MarkHidden("ready-fd")
	return c
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
			k, err := a.lib()
			if err != nil {
				return err
			}
			if installKey {
				if err := k.AuthorizeSSHKey(ctx, args[0]); err != nil {
					return err
				}
			}
			return k.Connect(ctx, args[0], "127.0.0.1:"+strconv.Itoa(port), kvbox.Pipe(a.raw.In, a.raw.Out))
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
				k, err := a.lib()
				if err != nil {
					return err
				}
				_, err = k.Box(c.Context(), n)
				return err
			}
			return nil
		},
	}
	c.Flags().StringVarP(&user, "user", "u", "root", "the user ssh logs in as")
	return c
}

// sshKeyPath is kvbox's SSH key of the state dir (kvbox.Host.SSHKey makes
// it).
func (a *app) sshKeyPath() string { return statedir.Layout{Root: a.stateDir}.SSHKey() }

func closeAll(ls []*net.TCPListener) {
	for _, l := range ls {
		l.Close()
	}
}
