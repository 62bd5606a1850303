package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/network"
)

func (a *app) newCmdNetwork() *cobra.Command {
	var asJSON, nat bool
	c := &cobra.Command{
		Use:   "network",
		Short: "Show, set up or remove kvbox's bridge and NAT rules",
	}
	up := &cobra.Command{
		Use:     "up",
		Short:   "Create the bridge and its firewall (and NAT where the host has a default route); kvbox new does this too",
		Example: "  kvbox network up\n  kvbox --bridge kvbox1 --subnet 172.31.0.0/24 network up --nat",
		Args:    exactArgs(0, "no arguments"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			st, err := k.NetworkUp(nat)
			if err != nil {
				return err
			}
			return a.printNetwork(st, asJSON)
		}),
	}
	up.Flags().BoolVar(&nat, "nat", false, "NAT even without a default route (the uplink is reached through other routes); kept until network rm")
	c.AddCommand(up, &cobra.Command{
		Use:     "show",
		Short:   "Show the bridge, its subnet and whether NAT is on",
		Example: "  kvbox network show --json",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, args []string) error {
			nc, err := a.network()
			if err != nil {
				return err
			}
			return a.printNetwork(nc.Status(), asJSON)
		},
	}, &cobra.Command{
		Use:     "rm",
		Short:   "Remove the bridge and kvbox's firewall rules (no box may use them)",
		Example: "  kvbox network rm",
		Args:    exactArgs(0, "no arguments"),
		RunE: a.withHost(func(c *cobra.Command, k *kvbox.Host, args []string) error {
			if err := k.RemoveNetwork(c.Context()); err != nil {
				return err
			}
			fmt.Fprintf(a.io.Out, "✓ network %s removed\n", k.Network().Bridge)
			return nil
		}),
	})
	c.PersistentFlags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

func (a *app) network() (network.Config, error) {
	nc, err := network.Parse(a.bridge, a.subnet)
	if err != nil {
		return network.Config{}, base.Errorf(base.Invalid, "%v", err)
	}
	return nc, nil
}

// printNetwork prints the bridge's status (--json: for programs).
func (a *app) printNetwork(st network.Status, asJSON bool) error {
	if asJSON {
		return a.printJSON(st)
	}
	fmt.Fprintf(a.io.Out, "bridge %s (%s), gateway %s, present %v, NAT %v\n", st.Bridge, st.Subnet, st.Gateway, st.Present, st.NAT)
	return nil
}
