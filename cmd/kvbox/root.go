package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/image"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/statedir"
	"kvbox.dev/kvbox/terminal"
)

// IO is where a command reads and writes; tests pass their own.
type IO struct {
	In       io.Reader
	Out, Err io.Writer
}

func stdio() IO {
	return IO{In: os.Stdin, Out: os.Stdout, Err: os.Stderr}
}

// printableIO is ios with standard output and error made printable.
func printableIO(ios IO) IO {
	ios.Out, ios.Err = terminal.Writer{W: ios.Out}, terminal.Writer{W: ios.Err}
	return ios
}

// app holds the global flags and the host they open.
type app struct {
	// io is where commands read and print: its Out and Err make what is
	// written printable (terminal.Writer); raw is the same without that, for
	// the bytes of exec, connect, ssh-proxy and cp to -, and the cursor
	// controls of progress lines.
	io, raw  IO
	uri      string
	stateDir string
	bridge   string
	subnet   string
	template string
	domType  string
	// dialTimeout bounds reaching a box's agent (dial and handshake).
	dialTimeout time.Duration
	// ctx ends waits on another kvbox's lock (Ctrl-C, SIGTERM).
	ctx  context.Context
	host *kvbox.Host
	// reaper says this kvbox is a box's or snapshot's reaper (__reap): it
	// does not sweep for expired boxes itself.
	reaper bool
}

func run(ctx context.Context, args []string, ios IO) int {
	a := &app{io: printableIO(ios), raw: ios, ctx: ctx}
	root := a.newRoot()
	root.SetArgs(args)
	root.SetIn(ios.In)
	root.SetOut(a.io.Out)
	root.SetErr(a.io.Err)
	err := root.ExecuteContext(ctx)
	if a.host != nil {
		a.host.Close()
	}
	if err == nil {
		return 0
	}
	var ec exitCodeError
	if errors.As(err, &ec) {
		return ec.code
	}
	fmt.Fprintf(a.io.Err, "kvbox: %s\n", err.Error())
	return exitCode(err)
}

func (a *app) newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "kvbox",
		Short: "Ready machines in well under a second: boxes, snapshots and warm clones on libvirt",
		Long: `kvbox runs boxes: libvirt domains with a guest agent and an address on the
kvbox bridge. A running box can be frozen into a snapshot (memory, CPU state
and disk) while it runs on, and cloned warm from it.`,
		Example: `  kvbox new dev
  kvbox exec dev -- uname -a
  kvbox connect dev
  kvbox snapshots new dev warm
  kvbox new --from warm agent-1`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return usage("%v (see %s --help)", err, c.CommandPath())
	})
	pf := root.PersistentFlags()
	pf.StringVarP(&a.uri, "connect", "c", domain.DefaultURI(), "libvirt connection URI (LIBVIRT_DEFAULT_URI)")
	pf.StringVar(&a.stateDir, "state-dir", envOr("KVBOX_STATE_DIR", "/var/lib/kvbox"), "where kvbox keeps boxes, images and snapshots (KVBOX_STATE_DIR)")
	pf.StringVar(&a.bridge, "bridge", envOr("KVBOX_BRIDGE", network.Default.Bridge), "bridge new boxes are put on (KVBOX_BRIDGE)")
	pf.StringVar(&a.subnet, "subnet", envOr("KVBOX_SUBNET", network.Default.Subnet.String()), "subnet of the bridge; the host is its first address (KVBOX_SUBNET)")
	pf.StringVar(&a.template, "template", os.Getenv("KVBOX_TEMPLATE"), "domain XML template file instead of the built-in one (KVBOX_TEMPLATE)")
	pf.StringVar(&a.domType, "domain-type", envOr("KVBOX_DOMAIN_TYPE", "auto"), "libvirt domain type: auto (kvm where the host offers it), kvm or qemu (KVBOX_DOMAIN_TYPE)")
	root.AddCommand(a.newCmdNew(), a.newCmdLs(), a.newCmdExec(), a.newCmdConnect(), a.newCmdStart(),
		a.newCmdStop(), a.newCmdRm(), a.newCmdImages(), a.newCmdSnapshots(), a.newCmdNetwork(), a.newCmdIP(),
		a.newCmdPortForward(), a.newCmdSSHProxy(), a.newCmdSSHConfig())
	root.AddCommand(a.newCmdCp())
	root.AddCommand(a.newCmdTTL(), a.newCmdReap(), a.newCmdSuspend(), a.newCmdResume())
	root.AddCommand(a.newCmdServe())
	root.AddCommand(a.newCmdEgress(), a.newCmdEgressProxy(), a.newCmdSecrets())
	pf.DurationVar(&a.dialTimeout, "dial-timeout", 15*time.Second, "how long exec and connect wait to reach a box's agent")
	a.addCompletions(root)
	// cobra adds `completion` only inside Execute, after rejectUnknown would
	// have run: add it now so `kvbox completion bogus` is refused too.
	root.InitDefaultCompletionCmd()
	rejectUnknown(root)
	return root
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// absPaths makes --state-dir and --template absolute: what kvbox starts
// (reapers, port holders) runs in / and is given them.
func (a *app) absPaths() error {
	for _, p := range []struct {
		flag string
		v    *string
	}{{"--state-dir", &a.stateDir}, {"--template", &a.template}} {
		if *p.v == "" || filepath.IsAbs(*p.v) {
			continue
		}
		abs, err := filepath.Abs(*p.v)
		if err != nil {
			return usage("%s %q is relative and the working directory cannot be read (%v): give an absolute path", p.flag, *p.v, err)
		}
		*p.v = abs
	}
	return nil
}

// lib opens the library's host on first use: every command first finishes
// what a killed kvbox left half-done and removes what expired (after a
// reboot no reaper runs), and says what it did on stderr.
func (a *app) lib() (*kvbox.Host, error) {
	if a.host != nil {
		return a.host, nil
	}
	if err := a.absPaths(); err != nil {
		return nil, err
	}
	nc, err := a.network()
	if err != nil {
		return nil, err
	}
	a.host, err = kvbox.Open(a.context(), kvbox.Config{URI: a.uri, StateDir: a.stateDir, Template: a.template, DomainType: a.domType,
		Network: nc, DialTimeout: a.dialTimeout, Notify: a.notify, ReaperCommand: a.reaperCommand, HolderCommand: a.holderCommand,
		ProxyCommand: a.proxyCommand, NoSweep: a.reaper})
	return a.host, err
}

// withHost is a command's RunE that opens the library's host (lib) first.
func (a *app) withHost(run func(c *cobra.Command, k *kvbox.Host, args []string) error) func(*cobra.Command, []string) error {
	return func(c *cobra.Command, args []string) error {
		k, err := a.lib()
		if err != nil {
			return err
		}
		return run(c, k, args)
	}
}

// notify prints what the library's host did on its own (recovery, the
// sweep) on stderr.
func (a *app) notify(n kvbox.Notice) {
	if n.Warning {
		fmt.Fprintf(a.io.Err, "kvbox: warning: %s\n", n.Text)
		return
	}
	fmt.Fprintf(a.io.Err, "kvbox: %s\n", n.Text)
}

// boxes connects and lists this state dir's boxes.
func (a *app) boxes() ([]kvbox.Box, error) {
	k, err := a.lib()
	if err != nil {
		return nil, err
	}
	return k.Boxes(a.context())
}

// context is the command's context (Ctrl-C, SIGTERM end it).
func (a *app) context() context.Context {
	if a.ctx == nil {
		return context.Background()
	}
	return a.ctx
}

func (a *app) images() image.Store {
	return image.Store{Dir: a.layout().Images()}
}

// layout is the state dir's layout.
func (a *app) layout() statedir.Layout { return statedir.Layout{Root: a.stateDir} }
