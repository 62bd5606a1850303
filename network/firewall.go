package network

import (
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/coreos/go-iptables/iptables"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/egress"
)

// Boxes reach the internet through the NAT and nothing else. kvbox's
// rules live in chains of their own, one pair per bridge, jumped to from
// the top of INPUT and FORWARD; `network rm` deletes the jumps and the
// chains and never touches another rule.

func (c Config) inChain() string  { return "KVBOX-IN-" + c.Bridge }
func (c Config) fwdChain() string { return "KVBOX-FWD-" + c.Bridge }

// Blocked are the destinations a box never reaches through the host:
// private ranges (the host's LAN, other bridges, other boxes' subnets),
// shared address space (carrier-grade NAT), link-local (a cloud's metadata
// service at 169.254.169.254), loopback, "this network", multicast and
// reserved space. One list with egress's, whose allow rules cannot open
// any of them.
var Blocked = egress.Blocked

func (c Config) jumps() []rule {
	comment := c.comment()
	return []rule{
		{"filter", "INPUT", append(append([]string{"-i", c.Bridge}, comment...), "-j", c.inChain())},
		{"filter", "FORWARD", append(append([]string{"-i", c.Bridge}, comment...), "-j", c.fwdChain())},
		{"filter", "FORWARD", append(append([]string{"-o", c.Bridge}, comment...), "-j", c.fwdChain())},
	}
}

func (c Config) comment() []string {
	return []string{"-m", "comment", "--comment", "kvbox " + c.Bridge}
}

// inRules: a box talks to the host only in connections the host opened
// (the host pings boxes, kvbox's tests connect to them). Boxes get their
// address from kvbox and their resolvers are the host's own upstream
// ones, so they need no service on the host.
func (c Config) inRules(resolvers []netip.Addr) [][]string {
	r := [][]string{{"-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"}}
	// A resolver may be one of the host's own addresses (a local dnsmasq).
	r = append(r, dnsRules(c.Bridge, c.Subnet.String(), resolvers)...)
	r = append(r, egressInRules()...)
	return append(r, []string{"-j", "DROP"})
}

// egressInRules let a box reach kvbox's egress proxy and resolver on the
// host only through its egress chains' redirect (egress.go): a box without
// a policy, or one that dials those ports itself, is dropped. Each state
// dir's proxy has ports of its own in egress's range, and a box's redirect
// names its own state dir's: the range is what a bridge's chain knows.
func egressInRules() [][]string {
	ports := fmt.Sprintf("%d:%d", egress.PortFirst, egress.PortLast)
	rule := func(proto string) []string {
		return []string{"-p", proto, "-m", "conntrack", "--ctstate", "DNAT", "-m", proto, "--dport", ports, "-j", "ACCEPT"}
	}
	return [][]string{rule("tcp"), rule("udp")}
}

func dnsRules(br, sub string, resolvers []netip.Addr) [][]string {
	var r [][]string
	for _, a := range resolvers {
		for _, p := range []string{"udp", "tcp"} {
			r = append(r, []string{"-s", sub, "-d", a.String() + "/32", "-i", br, "-p", p, "-m", p, "--dport", "53", "-j", "ACCEPT"})
		}
	}
	return r
}

// fwdRules: frames bridged between two ports (handed to iptables where
// br_netfilter is loaded) are left to the bridge, which isolates box ports,
// and to kvbox's port filter; replies come back; nothing new
// comes in; DNS to the host's resolvers passes even where they sit in a
// private range (a cloud's resolver); blocked ranges are dropped; the rest
// from the subnet goes out.
func (c Config) fwdRules(resolvers []netip.Addr) [][]string {
	br, sub := c.Bridge, c.Subnet.String()
	r := [][]string{
		{"-i", br, "-o", br, "-j", "ACCEPT"},
		{"-o", br, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"},
		{"-o", br, "-j", "DROP"},
	}
	r = append(r, dnsRules(br, sub, resolvers)...)
	for _, p := range Blocked {
		r = append(r, []string{"-d", p.String(), "-i", br, "-j", "DROP"})
	}
	return append(r,
		[]string{"-s", sub, "-i", br, "-j", "ACCEPT"},
		[]string{"-j", "DROP"},
	)
}

// Rule specs here are written in the order iptables -S prints them, so
// that one listing of a chain tells whether it is as kvbox wants it: every
// check costs one iptables run, and kvbox checks on every box it starts.

// line is how iptables -S prints a rule of chain.
func line(chain string, spec []string) string {
	q := make([]string, len(spec))
	for i, a := range spec {
		if strings.ContainsAny(a, " \t") {
			a = `"` + a + `"`
		}
		q[i] = a
	}
	return "-A " + chain + " " + strings.Join(q, " ")
}

// ensureChain makes chain hold exactly rules, in order. A chain already
// right is left alone (no window without rules); one that differs
// (changed resolvers, a hand edit) is flushed and refilled.
func ensureChain(ipt *iptables.IPTables, table, chain string, rules [][]string) error {
	// A missing chain fails to list; ClearChain below creates it.
	if have, err := ipt.List(table, chain); err == nil && slices.Equal(have, chainLines(chain, rules)) {
		return nil
	}
	if err := ipt.ClearChain(table, chain); err != nil {
		return err
	}
	for _, spec := range rules {
		if err := ipt.Append(table, chain, spec...); err != nil {
			return err
		}
	}
	return nil
}

// firewallRight reports, reading only, whether kvbox's chains and jumps
// for this bridge are exactly in place.
func (c Config) firewallRight(ipt *iptables.IPTables) bool {
	resolvers := Resolvers()
	for chain, rules := range map[string][][]string{c.inChain(): c.inRules(resolvers), c.fwdChain(): c.fwdRules(resolvers)} {
		have, err := ipt.List("filter", chain)
		if err != nil || !slices.Equal(have, chainLines(chain, rules)) {
			return false
		}
	}
	listed := map[string][]string{}
	for _, j := range c.jumps() {
		if listed[j.chain] == nil {
			l, err := ipt.List(j.table, j.chain)
			if err != nil {
				return false
			}
			listed[j.chain] = l
		}
		if !slices.Contains(listed[j.chain], line(j.chain, j.spec)) {
			return false
		}
	}
	return true
}

func (c Config) hasNAT(ipt *iptables.IPTables) bool { _, ok := c.natRule(ipt); return ok }

func chainLines(chain string, rules [][]string) []string {
	want := []string{"-N " + chain}
	for _, spec := range rules {
		want = append(want, line(chain, spec))
	}
	return want
}

// lockNetwork takes a host-wide lock for changing one bridge's rules.
// /run goes at reboot, as the rules do.
func lockNetwork(bridge string) (func(), error) {
	l, err := base.Lock("/run/kvbox-network-"+bridge+".lock", true)
	if err != nil {
		return nil, err
	}
	return l.Unlock, nil
}

func setForwarding() error {
	if err := os.WriteFile(ipForward, []byte("1\n"), 0o644); err != nil {
		return fmt.Errorf("enable IPv4 forwarding: %w", err)
	}
	return nil
}

// ensureFirewall puts kvbox's chains and their jumps in place.
func (c Config) ensureFirewall(ipt *iptables.IPTables) error {
	resolvers := Resolvers()
	if err := ensureChain(ipt, "filter", c.inChain(), c.inRules(resolvers)); err != nil {
		return fmt.Errorf("firewall for %s: %w", c.Bridge, err)
	}
	if err := ensureChain(ipt, "filter", c.fwdChain(), c.fwdRules(resolvers)); err != nil {
		return fmt.Errorf("firewall for %s: %w", c.Bridge, err)
	}
	listed := map[string][]string{}
	for _, j := range c.jumps() {
		if listed[j.chain] == nil {
			l, err := ipt.List(j.table, j.chain)
			if err != nil {
				return fmt.Errorf("firewall for %s: %w", c.Bridge, err)
			}
			listed[j.chain] = l
		}
		if !slices.Contains(listed[j.chain], line(j.chain, j.spec)) {
			// At the top: an ACCEPT of another firewall must not let a
			// box past kvbox's rules.
			if err := ipt.Insert(j.table, j.chain, 1, j.spec...); err != nil {
				return fmt.Errorf("firewall for %s: %w", c.Bridge, err)
			}
		}
	}
	return nil
}

func (c Config) removeFirewall(ipt *iptables.IPTables) []error {
	var errs []error
	for _, r := range c.jumps() {
		if err := deleteIfExists(ipt, r); err != nil {
			errs = append(errs, err)
		}
	}
	for _, ch := range []string{c.inChain(), c.fwdChain()} {
		if ok, _ := ipt.ChainExists("filter", ch); ok {
			if err := ipt.ClearAndDeleteChain("filter", ch); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errs
}

func deleteIfExists(ipt *iptables.IPTables, r rule) error {
	if ok, _ := ipt.Exists(r.table, r.chain, r.spec...); ok {
		return ipt.Delete(r.table, r.chain, r.spec...)
	}
	return nil
}

// masquerade is the NAT rule. Its comment records what ip_forward was
// before kvbox set it, so `network rm` can put it back: the record lives
// exactly as long as the rule (both go at reboot). prev is "0" or "1".
func (c Config) masquerade(prev string) rule {
	text := "kvbox " + c.Bridge + " ip_forward=" + prev
	return rule{"nat", "POSTROUTING", []string{"-s", c.Subnet.String(), "!", "-o", c.Bridge, "-m", "comment", "--comment", text, "-j", "MASQUERADE"}}
}

// natRule finds kvbox's masquerade rule for this bridge and what it
// recorded.
func (c Config) natRule(ipt *iptables.IPTables) (rule, bool) {
	have, err := ipt.List("nat", "POSTROUTING")
	if err != nil {
		return rule{}, false
	}
	for _, prev := range []string{"0", "1"} {
		r := c.masquerade(prev)
		if slices.Contains(have, line(r.chain, r.spec)) {
			return r, true
		}
	}
	return rule{}, false
}

const ipForward = "/proc/sys/net/ipv4/ip_forward"

func (c Config) ensureNAT(ipt *iptables.IPTables) error {
	if _, ok := c.natRule(ipt); !ok {
		b, err := os.ReadFile(ipForward)
		if err != nil {
			return fmt.Errorf("NAT for %s: %w", c.Bridge, err)
		}
		prev := "0"
		if strings.TrimSpace(string(b)) == "1" {
			prev = "1"
		}
		r := c.masquerade(prev)
		if err := ipt.Append(r.table, r.chain, r.spec...); err != nil {
			return fmt.Errorf("NAT for %s: %w", c.Bridge, err)
		}
	}
	return setForwarding()
}

// removeNAT deletes the masquerade rule and, when kvbox turned forwarding
// on and no other kvbox bridge still NATs, turns it off again.
func (c Config) removeNAT(ipt *iptables.IPTables) error {
	r, ok := c.natRule(ipt)
	if !ok {
		return nil
	}
	if err := ipt.Delete(r.table, r.chain, r.spec...); err != nil {
		return err
	}
	if !slices.Contains(r.spec, "kvbox "+c.Bridge+" ip_forward=0") {
		return nil
	}
	rules, err := ipt.List("nat", "POSTROUTING")
	if err != nil {
		return err
	}
	for _, l := range rules {
		if strings.Contains(l, `--comment "kvbox `) && strings.Contains(l, "MASQUERADE") {
			return nil // another kvbox bridge forwards still
		}
	}
	return os.WriteFile(ipForward, []byte("0\n"), 0o644)
}

// Resolvers are the host's non-loopback nameservers, which boxes are
// told to use.
func Resolvers() []netip.Addr {
	for _, f := range []string{"/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"} {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var ns []netip.Addr
		for _, line := range strings.Split(string(data), "\n") {
			fl := strings.Fields(line)
			if len(fl) >= 2 && fl[0] == "nameserver" {
				if a, err := netip.ParseAddr(fl[1]); err == nil && a.Is4() && !a.IsLoopback() && !slices.Contains(ns, a) {
					ns = append(ns, a)
				}
			}
		}
		if len(ns) > 0 {
			return ns
		}
	}
	return nil
}
