package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/kvbox"
)

// egressFlags are --egress, --allow and --deny, on new and egress set.
type egressFlags struct {
	mode                 string
	allow, deny, headers []string
}

func (e *egressFlags) add(f *pflag.FlagSet) {
	f.StringVar(&e.mode, "egress", "", "egress policy: deny-all (only --allow passes) or allow-all (only --deny is refused); with --from, the snapshot's policy unless given")
	f.StringArrayVar(&e.allow, "allow", nil, "let the box reach this IPv4 address, CIDR or host name (*.x: every name under x; names where addresses are denied, by TLS SNI on 443 and HTTP Host on 80); repeatable")
	f.StringArrayVar(&e.deny, "deny", nil, "keep the box from this IPv4 address or CIDR (an allow rule beats it); repeatable")
	f.StringArrayVar(&e.headers, "header", nil, "HOST:NAME=VALUE: set this header on the box's HTTPS requests to HOST, an --allow name (the proxy terminates TLS for it with the host's CA, which the box trusts); ${secret:NAME} in VALUE is a secret of kvbox secrets, never seen by the box; repeatable")
}

// changed says whether any of the flags was given.
func (e *egressFlags) changed(c *cobra.Command) bool {
	for _, n := range []string{"egress", "allow", "deny", "header"} {
		if c.Flags().Changed(n) {
			return true
		}
	}
	return false
}

// policy is the policy the flags give, nil when none was given.
func (e *egressFlags) policy(c *cobra.Command) (*egress.Policy, error) {
	if !e.changed(c) {
		return nil, nil
	}
	p, err := egress.Spec{Mode: e.mode, Allow: e.allow, Deny: e.deny, Headers: e.headers}.Policy()
	if err != nil {
		return nil, err
	}
	return &p, nil
}

func (a *app) newCmdEgress() *cobra.Command {
	c := &cobra.Command{
		Use:   "egress",
		Short: "Show or replace a box's egress policy (what it may reach beyond its bridge)",
		Long: `A box's egress policy allows and denies destinations: IPv4 addresses and
CIDRs, and host names where addresses are denied. An allow rule beats a deny
rule. A name is matched on the TLS server name (SNI) of a connection to port
443 and the Host header of one to port 80, by kvbox's proxy on the host, which
dials the name itself; every DNS query of the box goes to kvbox's resolver,
which under deny-all answers only allowed names. The policy is part of the box
(virsh dumpxml shows it), and its clones have it unless they are given another.`,
	}
	var asJSON bool
	show := &cobra.Command{
		Use:     "show NAME",
		Short:   "Show a box's egress policy, whether it is in force, and what was refused lately",
		Example: "  kvbox egress show job-1\n  kvbox egress show --json job-1",
		Args:    exactArgs(1, "a box name"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			st, err := k.Egress(c.Context(), args[0])
			if err != nil {
				return err
			}
			return a.printEgress(st, asJSON)
		}),
	}
	show.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	var ef egressFlags
	set := &cobra.Command{
		Use:   "set NAME",
		Short: "Replace a box's egress policy whole, at once, while it runs",
		Long: `Replace a box's egress policy whole: the flags are the new policy, nothing of
the old one stays. New connections meet it at once; the box is neither paused
nor restarted. --egress allow-all alone takes the policy away.`,
		Example: `  kvbox egress set job-1 --egress deny-all --allow api.anthropic.com --allow codeload.github.com
  kvbox egress set job-1 --deny 198.51.100.0/24
  kvbox egress set job-1 --egress allow-all`,
		Args: exactArgs(1, "a box name"),
		RunE: func(c *cobra.Command, args []string) error {
			p, err := ef.policy(c)
			if err != nil {
				return err
			}
			if p == nil {
				return usage("give the new policy: --egress deny-all or allow-all, --allow, --deny")
			}
			k, err := a.lib()
			if err != nil {
				return err
			}
			st, err := k.SetEgress(c.Context(), args[0], *p)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printEgress(st, true)
			}
			fmt.Fprintf(a.io.Out, "✓ box %s: egress %s (for new connections, from now)\n", st.Box, st.Policy)
			return nil
		},
	}
	ef.add(set.Flags())
	set.Flags().BoolVar(&asJSON, "json", false, "print the new status as JSON")
	c.AddCommand(show, set)
	return c
}

func (a *app) printEgress(st kvbox.EgressStatus, asJSON bool) error {
	if asJSON {
		b, err := json.MarshalIndent(st, "", "  ")
		if err != nil {
			return err
		}
		fmt.Fprintln(a.io.Out, string(b))
		return nil
	}
	fmt.Fprintf(a.io.Out, "box:     %s\n", st.Box)
	fmt.Fprintf(a.io.Out, "policy:  %s\n", st.Policy)
	if st.Policy.IsZero() {
		return nil
	}
	state := "in force"
	if !st.InForce {
		state = "NOT in force (the box is not running on this host's network, or its rules were taken away: kvbox start)"
	}
	proxy := "running"
	if !st.ProxyRunning {
		proxy = "NOT running (names and DNS are refused until a kvbox command starts it)"
	}
	fmt.Fprintf(a.io.Out, "rules:   %s; egress proxy %s\n", state, proxy)
	fmt.Fprintf(a.io.Out, "dropped: %d packets to denied addresses\n", st.Dropped)
	if len(st.Refused) == 0 {
		fmt.Fprintln(a.io.Out, "refused: nothing lately")
		return nil
	}
	fmt.Fprintln(a.io.Out, "refused lately:")
	for _, l := range st.Refused {
		fmt.Fprintf(a.io.Out, "  %s\n", l)
	}
	return nil
}

// proxyCommand re-runs this kvbox as the state dir's egress proxy (the
// supervisor), or with worker as one of its workers.
func (a *app) proxyCommand(readyFD int) *exec.Cmd { return a.egressCommand(readyFD, false) }

func (a *app) egressCommand(readyFD int, worker bool) *exec.Cmd {
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	args := []string{"--state-dir", absOr(a.stateDir), kvbox.EgressProxyArg, "--ready-fd", strconv.Itoa(readyFD)}
	if worker {
		args = append(args, "--worker")
	}
	cmd := exec.Command(exe, args...)
	cmd.Dir = "/"
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVBOX_TEST_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	if worker {
		// The worker logs where its supervisor does.
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	}
	return cmd
}

// newCmdEgressProxy is the hidden egress proxy: the supervisor
// (kvbox.RunEgressProxy), started detached by kvbox (Config.ProxyCommand),
// or with --worker one of its workers (kvbox.ServeEgressProxy).
func (a *app) newCmdEgressProxy() *cobra.Command {
	var readyFD int
	var worker bool
	c := &cobra.Command{
		Use:     kvbox.EgressProxyArg,
		Hidden:  true,
		Example: "  (started by kvbox itself while a box has an egress policy)",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, args []string) error {
			if err := a.absPaths(); err != nil {
				return err
			}
			ready := os.NewFile(uintptr(readyFD), "ready")
			if ready == nil {
				return usage("--ready-fd %d is not open", readyFD)
			}
			if worker {
				return kvbox.ServeEgressProxy(c.Context(), a.stateDir, os.Getenv("KVBOX_EGRESS_UPSTREAM"), os.Getenv("KVBOX_EGRESS_UPSTREAM_CA"), ready, a.io.Err)
			}
			return kvbox.RunEgressProxy(c.Context(), a.stateDir, func(fd int) *exec.Cmd { return a.egressCommand(fd, true) }, ready, a.io.Err)
		},
	}
	c.Flags().IntVar(&readyFD, "ready-fd", 3, "the fd to write ok (or error: ...) on once it serves")
	c.Flags().BoolVar(&worker, "worker", false, "serve as one worker of the supervisor")
	return c
}

func (a *app) newCmdSecrets() *cobra.Command {
	c := &cobra.Command{
		Use:   "secrets",
		Short: "Keep secrets on the host for egress header transforms (never seen by a box)",
		Long: `A secret is a value kept on the host, root's only, under the state dir. A
box's egress policy names it in a header transform (--header
'api.openai.com:Authorization=Bearer ${secret:openai}'); kvbox's egress proxy
sets the header on the box's requests to that name. The value never enters a
box, its definition, a snapshot or a log.`,
	}
	set := &cobra.Command{
		Use:     "set NAME",
		Short:   "Keep the value on stdin as secret NAME (replacing it)",
		Example: "  kvbox secrets set openai < key.txt",
		Args:    exactArgs(1, "a secret name"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			v, err := io.ReadAll(io.LimitReader(a.io.In, 64<<10+1))
			if err != nil {
				return err
			}
			if len(v) > 64<<10 {
				return usage("a secret has at most 64 KiB")
			}
			if err := k.SetSecret(args[0], v); err != nil {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ secret %s kept (root's only, on this host)\n", args[0])
			return nil
		}),
	}
	ls := &cobra.Command{
		Use:     "ls",
		Short:   "List the secrets' names (never their values)",
		Example: "  kvbox secrets ls",
		Args:    exactArgs(0, "no arguments"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			names, err := k.Secrets()
			if err != nil {
				return err
			}
			for _, n := range names {
				fmt.Fprintln(a.io.Out, n)
			}
			return nil
		}),
	}
	rm := &cobra.Command{
		Use:     "rm NAME",
		Short:   "Remove a secret (a header naming it fails its requests from then on)",
		Example: "  kvbox secrets rm openai",
		Args:    exactArgs(1, "a secret name"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			if err := k.RemoveSecret(args[0]); err != nil {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ secret %s removed\n", args[0])
			return nil
		}),
	}
	c.AddCommand(set, ls, rm)
	return c
}
