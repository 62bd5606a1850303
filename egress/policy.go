// Package egress is a box's outbound traffic policy and the host-side
// proxy and resolver that enforce its domain rules.
//
// The semantics are E2B's: a policy allows and denies destinations; allow
// beats deny; an allow rule is an IPv4 address, a CIDR or a host name
// (`*.x` matches every name under x); a deny rule is an address or a CIDR
// only: a name can be allowed where addresses are denied, never denied.
// Denying 0.0.0.0/0 is E2B's `allowInternetAccess: false`. Address rules
// are kernel rules (nftables, package network); a name is matched by the
// proxy on the TLS SNI of a connection to port 443 and the Host header of
// one to port 80, and the proxy dials the name itself (Proxy).
package egress

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"kvbox.dev/kvbox/base"
)

// Policy is a box's egress policy as kept in its definition (the kvbox
// metadata of its domain XML, <egress>): rules in their canonical text.
// The zero Policy allows everything, as a box without one.
type Policy struct {
	// Allow holds addresses and CIDRs (canonical: a.b.c.d/n) and host
	// names (lower case, no trailing dot; *.x for x's subdomains).
	Allow []string `xml:"allow" json:"allow,omitempty"`
	// Deny holds CIDRs.
	Deny []string `xml:"deny" json:"deny,omitempty"`
	// Headers are set on the HTTPS requests to an allowed name by the
	// proxy, which terminates TLS for that name alone; a value names
	// secrets (${secret:NAME}), never holds one kvbox put there.
	Headers []Header `xml:"header" json:"headers,omitempty"`
}

// Header is one header transform: Name set to Value (its ${secret:NAME}
// references resolved by the proxy) on every request to Host, a name
// rule of the policy's (exact, or *.x).
type Header struct {
	Host  string `xml:"host,attr" json:"host"`
	Name  string `xml:"name,attr" json:"name"`
	Value string `xml:",chardata" json:"value"`
}

// The modes of Spec.Mode.
const (
	AllowAll = "allow-all"
	DenyAll  = "deny-all"
)

// Everything is the CIDR that deny-all denies.
var Everything = netip.MustParsePrefix("0.0.0.0/0")

// MaxRules bounds the rules of one policy (each address rule is a kernel
// rule on the box's every new packet).
const MaxRules = 256

// Spec is a policy as a user gives it: a mode and rules, in any of the
// forms Parse takes.
type Spec struct {
	// Mode is "" or AllowAll (nothing denied but Deny) or DenyAll
	// (0.0.0.0/0 denied: only Allow passes).
	Mode  string
	Allow []string
	Deny  []string
	// Headers are HOST:NAME=VALUE, HOST an allowed name rule.
	Headers []string
}

// Empty says the spec names no policy at all.
func (s Spec) Empty() bool {
	return s.Mode == "" && len(s.Allow) == 0 && len(s.Deny) == 0 && len(s.Headers) == 0
}

// Policy checks s and returns its canonical policy, or one line saying
// what is wrong with the first rule that is.
func (s Spec) Policy() (Policy, error) {
	var p Policy
	switch s.Mode {
	case "", AllowAll:
	case DenyAll:
		p.Deny = append(p.Deny, Everything.String())
	default:
		return Policy{}, base.Errorf(base.Invalid, "--egress %q: give allow-all or deny-all", s.Mode)
	}
	for _, a := range s.Allow {
		r, err := parseRule(a, true)
		if err != nil {
			return Policy{}, err
		}
		p.Allow = appendNew(p.Allow, r)
	}
	for _, d := range s.Deny {
		r, err := parseRule(d, false)
		if err != nil {
			return Policy{}, err
		}
		p.Deny = appendNew(p.Deny, r)
	}
	for _, h := range s.Headers {
		hd, err := parseHeader(h)
		if err != nil {
			return Policy{}, err
		}
		p.Headers = append(p.Headers, hd)
	}
	if err := p.Validate(); err != nil {
		return Policy{}, err
	}
	return p, nil
}

func appendNew(l []string, s string) []string {
	if slices.Contains(l, s) {
		return l
	}
	return append(l, s)
}

// IsZero says the policy allows everything (no rule at all).
func (p Policy) IsZero() bool { return len(p.Allow) == 0 && len(p.Deny) == 0 && len(p.Headers) == 0 }

// Validate checks a policy read back from a definition (a pulled
// snapshot's is untrusted input): every rule canonical, and the rules
// meaning something together.
func (p Policy) Validate() error {
	if n := len(p.Allow) + len(p.Deny) + len(p.Headers); n > MaxRules {
		return base.Errorf(base.Invalid, "egress policy: %d rules, at most %d", n, MaxRules)
	}
	c, err := p.Compile()
	if err != nil {
		return err
	}
	if len(c.Names) > 0 && len(c.DenyNets) == 0 {
		return base.Errorf(base.Invalid, "--allow %s: a host name rule means something only where addresses are denied (--egress deny-all, or --deny CIDR): nothing is denied", c.Names[0])
	}
	for _, h := range p.Headers {
		if err := checkHeader(h); err != nil {
			return err
		}
		hn := nameOf(h.Host)
		if !slices.ContainsFunc(c.Names, hn.overlaps) {
			return base.Errorf(base.Invalid, "--header %s:%s: %s is not an allowed name of the policy (--allow %s): a header is set only on requests the proxy lets through by name", h.Host, h.Name, h.Host, h.Host)
		}
		if !c.FiltersDNS() {
			return base.Errorf(base.Invalid, "--header %s:%s: a header is set only where every address is denied (--egress deny-all): elsewhere a connection to %s's address would pass without the proxy, and without the header", h.Host, h.Name, h.Host)
		}
	}
	return nil
}

// nameOf is a canonical name rule (x or *.x) parsed.
func nameOf(rule string) Name {
	host, wild := strings.CutPrefix(rule, "*.")
	return Name{Host: host, Wildcard: wild}
}

// overlaps says whether some host name matches both n and o.
func (n Name) overlaps(o Name) bool {
	switch {
	case !n.Wildcard && !o.Wildcard:
		return n.Host == o.Host
	case !n.Wildcard:
		return o.Matches(n.Host)
	case !o.Wildcard:
		return n.Matches(o.Host)
	}
	return n.Host == o.Host || n.Matches(o.Host) || o.Matches(n.Host)
}

// HeadersFor are the header transforms for requests to host, as E2B
// picks a rule: the headers of an exact host rule, else those of the
// longest wildcard rule that matches; never a merge of two rules. Their
// order is the policy's (a later one of the same name wins).
func (p Policy) HeadersFor(host string) []Header {
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	best, bestLen := "", -1
	for _, h := range p.Headers {
		n := nameOf(h.Host)
		if !n.Matches(host) {
			continue
		}
		l := len(n.Host)
		if !n.Wildcard {
			l = len(host) + 1 // an exact rule beats every wildcard
		}
		if l > bestLen {
			best, bestLen = h.Host, l
		}
	}
	var out []Header
	for _, h := range p.Headers {
		if bestLen >= 0 && h.Host == best {
			out = append(out, h)
		}
	}
	return out
}

// Compiled is a policy's rules parsed.
type Compiled struct {
	AllowNets []netip.Prefix
	DenyNets  []netip.Prefix
	Names     []Name
}

// Name is a host name rule: Host itself, or with Wildcard every name
// under Host (not Host).
type Name struct {
	Host     string
	Wildcard bool
}

func (n Name) String() string {
	if n.Wildcard {
		return "*." + n.Host
	}
	return n.Host
}

// Matches says whether host (any case, a trailing dot or not) is
// allowed by n.
func (n Name) Matches(host string) bool {
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	if n.Wildcard {
		return strings.HasSuffix(host, "."+n.Host)
	}
	return host == n.Host
}

// Compile parses the policy's canonical rules; a rule not in canonical
// form is refused.
func (p Policy) Compile() (Compiled, error) {
	var c Compiled
	for _, a := range p.Allow {
		r, err := parseRule(a, true)
		if err != nil {
			return Compiled{}, err
		}
		if r != a {
			return Compiled{}, base.Errorf(base.Invalid, "egress rule %q is not in canonical form (%q)", a, r)
		}
		if pr, err := netip.ParsePrefix(r); err == nil {
			c.AllowNets = append(c.AllowNets, pr)
		} else {
			host, wild := strings.CutPrefix(r, "*.")
			c.Names = append(c.Names, Name{Host: host, Wildcard: wild})
		}
	}
	for _, d := range p.Deny {
		r, err := parseRule(d, false)
		if err != nil {
			return Compiled{}, err
		}
		if r != d {
			return Compiled{}, base.Errorf(base.Invalid, "egress rule %q is not in canonical form (%q)", d, r)
		}
		c.DenyNets = append(c.DenyNets, netip.MustParsePrefix(r))
	}
	return c, nil
}

// AllowsName says whether a connection to host passes by a name rule.
func (c Compiled) AllowsName(host string) bool {
	return slices.ContainsFunc(c.Names, func(n Name) bool { return n.Matches(host) })
}

// AllowsAddr says whether a packet to a passes the address rules: allowed
// by one, or denied by none.
func (c Compiled) AllowsAddr(a netip.Addr) bool {
	for _, p := range c.AllowNets {
		if p.Contains(a) {
			return true
		}
	}
	for _, p := range c.DenyNets {
		if p.Contains(a) {
			return false
		}
	}
	return true
}

// FiltersDNS says whether the box's resolver answers only allowed names:
// where everything is denied, a name not allowed resolves to nothing (the
// box learns no address it could not reach, and DNS carries nothing out).
func (c Compiled) FiltersDNS() bool { return slices.Contains(c.DenyNets, Everything) }

// AllowsQuery says whether the resolver answers a query for name.
func (c Compiled) AllowsQuery(name string) bool { return !c.FiltersDNS() || c.AllowsName(name) }

// Blocked are the ranges a box never reaches whatever its policy (the
// host's firewall drops them: network.Blocked is this list): an allow
// rule cannot open one.
var Blocked = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("224.0.0.0/3"),
}

// IsBlocked says whether a is in a range no box reaches.
func IsBlocked(a netip.Addr) bool {
	return slices.ContainsFunc(Blocked, func(p netip.Prefix) bool { return p.Contains(a) })
}

// parseRule reads one rule as a user writes it (an IPv4 address, a CIDR,
// a host name, *.name; allow says it is an allow rule) and returns its
// canonical text, or one line saying what is wrong.
func parseRule(s string, allow bool) (string, error) {
	flag := "--deny"
	if allow {
		flag = "--allow"
	}
	bad := func(format string, a ...any) error {
		return base.Errorf(base.Invalid, "%s %q: %s", flag, s, fmt.Sprintf(format, a...))
	}
	r := strings.TrimSpace(s)
	switch {
	case r == "":
		return "", bad("an empty rule")
	case strings.Contains(r, "://"):
		return "", bad("give a host name, an address or a CIDR, not a URL")
	case strings.ContainsAny(r, " \t\r\n"):
		return "", bad("holds spaces")
	}
	if a, err := netip.ParseAddr(r); err == nil {
		if !a.Is4() || a.Is4In6() {
			return "", bad("boxes have no IPv6 (kvbox's port filter drops all of it): an IPv6 rule means nothing")
		}
		r = a.String() + "/32"
	}
	if strings.Contains(r, "/") {
		p, err := netip.ParsePrefix(r)
		if err != nil {
			if strings.Contains(r, ":") {
				return "", bad("boxes have no IPv6 (kvbox's port filter drops all of it): an IPv6 rule means nothing")
			}
			return "", bad("not a CIDR like 203.0.113.0/24")
		}
		if !p.Addr().Is4() || p.Addr().Is4In6() {
			return "", bad("boxes have no IPv6 (kvbox's port filter drops all of it): an IPv6 rule means nothing")
		}
		if p.Masked() != p {
			return "", bad("has bits set past its prefix length: did you mean %s?", p.Masked())
		}
		if allow && p.Bits() > 0 {
			for _, b := range Blocked {
				if b.Bits() <= p.Bits() && b.Contains(p.Addr()) {
					return "", bad("%s is a range no box ever reaches (private, loopback, link-local, multicast: the host's LAN and metadata services): an allow rule cannot open it", b)
				}
			}
		}
		return p.String(), nil
	}
	if !allow {
		return "", bad("kvbox cannot deny a host name, only allow one where addresses are denied (--egress deny-all --allow NAME); give an address or a CIDR")
	}
	if strings.Contains(r, ":") {
		return "", bad("a rule names a host, not a port: leave out the port (ports 443 and 80 are matched by name)")
	}
	name := strings.TrimSuffix(strings.ToLower(r), ".")
	host, wild := strings.CutPrefix(name, "*.")
	if strings.Contains(host, "*") {
		if name == "*" {
			return "", bad("* would allow every name: leave out --egress deny-all instead")
		}
		return "", bad("a wildcard is *.NAME only, at the start")
	}
	if err := validHost(host); err != nil {
		return "", bad("%v", err)
	}
	if wild {
		return "*." + host, nil
	}
	return host, nil
}

// NameRule is the canonical form of a host name rule (a name, or *.name),
// or one line saying why s is not one.
func NameRule(s string) (string, error) {
	r, err := parseRule(s, true)
	if err != nil {
		return "", err
	}
	if strings.Contains(r, "/") {
		return "", base.Errorf(base.Invalid, "%q: an address, not a host name", s)
	}
	return r, nil
}

// validHost checks a DNS host name (in ASCII, an IDN in its xn-- form).
func validHost(h string) error {
	if len(h) > 253 {
		return fmt.Errorf("a host name has at most 253 characters")
	}
	labels := strings.Split(h, ".")
	if len(labels) < 2 {
		return fmt.Errorf("not a host name like api.example.com (a name rule needs a domain)")
	}
	allDigits := true
	for _, l := range labels {
		if l == "" {
			return fmt.Errorf("an empty label (two dots, or a dot at the start)")
		}
		if len(l) > 63 {
			return fmt.Errorf("label %q is longer than 63 characters", l)
		}
		for i, c := range []byte(l) {
			switch {
			case c >= 'a' && c <= 'z', c == '_':
				allDigits = false
			case c >= '0' && c <= '9':
			case c == '-' && i > 0 && i < len(l)-1:
				allDigits = false
			case c >= 0x80:
				return fmt.Errorf("not ASCII: give an international name in its xn-- form")
			default:
				return fmt.Errorf("%q is not a host name's character", c)
			}
		}
	}
	if allDigits {
		return fmt.Errorf("neither an IPv4 address nor a host name")
	}
	return nil
}

// String is the policy as flags: what `kvbox egress show` prints and
// `kvbox egress set` takes.
func (p Policy) String() string {
	if p.IsZero() {
		return "--egress allow-all"
	}
	var parts []string
	deny := p.Deny
	if slices.Contains(deny, Everything.String()) {
		parts = append(parts, "--egress deny-all")
		deny = slices.DeleteFunc(slices.Clone(deny), func(d string) bool { return d == Everything.String() })
	}
	for _, d := range deny {
		parts = append(parts, "--deny "+d)
	}
	for _, a := range p.Allow {
		parts = append(parts, "--allow "+a)
	}
	for _, h := range p.Headers {
		parts = append(parts, fmt.Sprintf("--header '%s:%s=%s'", h.Host, h.Name, h.Value))
	}
	return strings.Join(parts, " ")
}
