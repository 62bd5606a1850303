package egress

import (
	"encoding/xml"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestSpecPolicy(t *testing.T) {
	for _, tc := range []struct {
		name  string
		spec  Spec
		allow []string
		deny  []string
		err   string // part of the error; "" for none
	}{
		{name: "nothing", spec: Spec{}},
		{name: "allow-all", spec: Spec{Mode: "allow-all"}},
		{name: "deny-all", spec: Spec{Mode: "deny-all"}, deny: []string{"0.0.0.0/0"}},
		{name: "the issue's", spec: Spec{Mode: "deny-all", Allow: []string{"api.anthropic.com", "*.github.com", "203.0.113.0/24"}},
			allow: []string{"api.anthropic.com", "*.github.com", "203.0.113.0/24"}, deny: []string{"0.0.0.0/0"}},
		{name: "address is a /32", spec: Spec{Deny: []string{"198.51.100.7"}}, deny: []string{"198.51.100.7/32"}},
		{name: "case, trailing dot, spaces", spec: Spec{Mode: "deny-all", Allow: []string{" API.Example.COM. ", "*.Example.org"}},
			allow: []string{"api.example.com", "*.example.org"}, deny: []string{"0.0.0.0/0"}},
		{name: "duplicates kept once", spec: Spec{Mode: "deny-all", Deny: []string{"0.0.0.0/0", "198.51.100.0/24", "198.51.100.0/24"}, Allow: []string{"a.example", "A.example"}},
			allow: []string{"a.example"}, deny: []string{"0.0.0.0/0", "198.51.100.0/24"}},
		{name: "allow beats deny, both CIDRs", spec: Spec{Deny: []string{"198.51.100.0/24"}, Allow: []string{"198.51.100.10"}},
			allow: []string{"198.51.100.10/32"}, deny: []string{"198.51.100.0/24"}},
		{name: "underscore label", spec: Spec{Mode: "deny-all", Allow: []string{"_dmarc.example.com"}}, allow: []string{"_dmarc.example.com"}, deny: []string{"0.0.0.0/0"}},
		{name: "punycode", spec: Spec{Mode: "deny-all", Allow: []string{"xn--bcher-kva.example"}}, allow: []string{"xn--bcher-kva.example"}, deny: []string{"0.0.0.0/0"}},

		{name: "unknown mode", spec: Spec{Mode: "deny"}, err: `--egress "deny": give allow-all or deny-all`},
		{name: "mode case", spec: Spec{Mode: "Deny-All"}, err: "give allow-all or deny-all"},
		{name: "empty rule", spec: Spec{Mode: "deny-all", Allow: []string{""}}, err: "an empty rule"},
		{name: "blank rule", spec: Spec{Mode: "deny-all", Allow: []string{"  "}}, err: "an empty rule"},
		{name: "URL", spec: Spec{Mode: "deny-all", Allow: []string{"https://api.openai.com/v1"}}, err: "not a URL"},
		{name: "port", spec: Spec{Mode: "deny-all", Allow: []string{"api.openai.com:443"}}, err: "not a port"},
		{name: "address with port", spec: Spec{Deny: []string{"198.51.100.1:80"}}, err: "cannot deny a host name"},
		{name: "space inside", spec: Spec{Mode: "deny-all", Allow: []string{"a.example b.example"}}, err: "holds spaces"},
		{name: "comma list", spec: Spec{Mode: "deny-all", Allow: []string{"a.example,b.example"}}, err: "not a host name's character"},
		{name: "IPv6 address", spec: Spec{Deny: []string{"2001:db8::1"}}, err: "no IPv6"},
		{name: "IPv6 CIDR", spec: Spec{Deny: []string{"::/0"}}, err: "no IPv6"},
		{name: "IPv4-mapped", spec: Spec{Deny: []string{"::ffff:198.51.100.1"}}, err: "no IPv6"},
		{name: "bad CIDR", spec: Spec{Deny: []string{"198.51.100.0/33"}}, err: "not a CIDR"},
		{name: "short address", spec: Spec{Deny: []string{"198.51.100/24"}}, err: "not a CIDR"},
		{name: "host bits", spec: Spec{Deny: []string{"198.51.100.1/24"}}, err: "did you mean 198.51.100.0/24"},
		{name: "deny a name", spec: Spec{Deny: []string{"evil.example"}}, err: "cannot deny a host name"},
		{name: "name, nothing denied", spec: Spec{Allow: []string{"api.example.com"}}, err: "only where addresses are denied"},
		{name: "bare star", spec: Spec{Mode: "deny-all", Allow: []string{"*"}}, err: "every name"},
		{name: "star inside", spec: Spec{Mode: "deny-all", Allow: []string{"api.*.example.com"}}, err: "*.NAME only"},
		{name: "star glued", spec: Spec{Mode: "deny-all", Allow: []string{"*example.com"}}, err: "*.NAME only"},
		{name: "double star", spec: Spec{Mode: "deny-all", Allow: []string{"*.*.example.com"}}, err: "*.NAME only"},
		{name: "single label", spec: Spec{Mode: "deny-all", Allow: []string{"localhost"}}, err: "needs a domain"},
		{name: "wildcard of a TLD", spec: Spec{Mode: "deny-all", Allow: []string{"*.com"}}, err: "needs a domain"},
		{name: "double dot", spec: Spec{Mode: "deny-all", Allow: []string{"a..example"}}, err: "empty label"},
		{name: "leading dot", spec: Spec{Mode: "deny-all", Allow: []string{".example.com"}}, err: "empty label"},
		{name: "long label", spec: Spec{Mode: "deny-all", Allow: []string{strings.Repeat("a", 64) + ".example"}}, err: "longer than 63"},
		{name: "long name", spec: Spec{Mode: "deny-all", Allow: []string{strings.Repeat("a.", 127) + "ex"}}, err: "at most 253"},
		{name: "hyphen at a label's end", spec: Spec{Mode: "deny-all", Allow: []string{"a-.example"}}, err: "not a host name's character"},
		{name: "unicode", spec: Spec{Mode: "deny-all", Allow: []string{"bücher.example"}}, err: "xn-- form"},
		{name: "numeric name", spec: Spec{Mode: "deny-all", Allow: []string{"1.2.3"}}, err: "neither an IPv4 address"},
		{name: "private range", spec: Spec{Mode: "deny-all", Allow: []string{"10.20.0.0/16"}}, err: "10.0.0.0/8 is a range no box ever reaches"},
		{name: "metadata address", spec: Spec{Mode: "deny-all", Allow: []string{"169.254.169.254"}}, err: "no box ever reaches"},
		{name: "loopback", spec: Spec{Mode: "deny-all", Allow: []string{"127.0.0.1"}}, err: "no box ever reaches"},
		{name: "too many", spec: Spec{Mode: "deny-all", Allow: manyNames(MaxRules)}, err: "at most"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := tc.spec.Policy()
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("got %v, %v; want an error with %q", p, err, tc.err)
				}
				if strings.Contains(err.Error(), "\n") {
					t.Errorf("error spans lines: %q", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(p.Allow, tc.allow) || !slices.Equal(p.Deny, tc.deny) {
				t.Fatalf("got allow %q deny %q; want %q %q", p.Allow, p.Deny, tc.allow, tc.deny)
			}
			if err := p.Validate(); err != nil {
				t.Fatalf("a policy Spec made fails Validate: %v", err)
			}
		})
	}
}

func manyNames(n int) []string {
	var l []string
	for i := range n {
		l = append(l, "h"+strings.Repeat("x", i%5)+string(rune('a'+i%26))+".n"+string(rune('a'+i/26))+".example")
	}
	return l
}

func TestCompiledMatches(t *testing.T) {
	p, err := Spec{Mode: DenyAll, Allow: []string{"api.example.com", "*.github.com", "203.0.113.0/24"}, Deny: []string{"198.51.100.0/24"}}.Policy()
	if err != nil {
		t.Fatal(err)
	}
	c, err := p.Compile()
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]bool{
		"api.example.com": true, "API.example.com.": true, "x.api.example.com": false, "example.com": false,
		"codeload.github.com": true, "a.b.github.com": true, "github.com": false, "evilgithub.com": false,
		"github.com.evil.example": false, "": false,
	} {
		if got := c.AllowsName(host); got != want {
			t.Errorf("AllowsName(%q) = %v, want %v", host, got, want)
		}
	}
	for a, want := range map[string]bool{"203.0.113.7": true, "198.51.100.1": false, "192.0.2.1": false} {
		if got := c.AllowsAddr(netip.MustParseAddr(a)); got != want {
			t.Errorf("AllowsAddr(%s) = %v, want %v", a, got, want)
		}
	}
	if !c.FiltersDNS() || c.AllowsQuery("other.example") || !c.AllowsQuery("x.github.com") {
		t.Error("a deny-all policy's resolver answers only allowed names")
	}
	open, _ := Spec{Deny: []string{"198.51.100.0/24"}}.Policy()
	oc, _ := open.Compile()
	if oc.FiltersDNS() || !oc.AllowsQuery("anything.example") || !oc.AllowsAddr(netip.MustParseAddr("192.0.2.1")) {
		t.Error("a deny-list policy resolves every name and passes what it does not deny")
	}
}

// A policy read back from a definition must be canonical: a hand-edited or
// pulled one is checked as strictly as a user's.
func TestValidateRefusesNonCanonical(t *testing.T) {
	for _, p := range []Policy{
		{Deny: []string{"0.0.0.0/0"}, Allow: []string{"API.example.com"}},
		{Deny: []string{"198.51.100.1"}},
		{Deny: []string{"evil.example"}},
		{Allow: []string{"a.example"}},
		{Deny: []string{"0.0.0.0/0"}, Allow: []string{"10.0.0.0/8"}},
	} {
		if err := p.Validate(); err == nil {
			t.Errorf("Validate(%+v) passed", p)
		}
	}
}

func TestPolicyXMLAndString(t *testing.T) {
	p, _ := Spec{Mode: DenyAll, Allow: []string{"a.example", "*.b.example"}, Deny: []string{"198.51.100.0/24"}}.Policy()
	b, err := xml.Marshal(struct {
		XMLName xml.Name `xml:"egress"`
		Policy
	}{Policy: p})
	if err != nil {
		t.Fatal(err)
	}
	want := "<egress><allow>a.example</allow><allow>*.b.example</allow><deny>0.0.0.0/0</deny><deny>198.51.100.0/24</deny></egress>"
	if string(b) != want {
		t.Errorf("XML %s, want %s", b, want)
	}
	if s := p.String(); s != "--egress deny-all --deny 198.51.100.0/24 --allow a.example --allow *.b.example" {
		t.Errorf("String %q", s)
	}
	if s := (Policy{}).String(); s != "--egress allow-all" {
		t.Errorf("zero String %q", s)
	}
}

func TestHeaderRules(t *testing.T) {
	base := Spec{Mode: DenyAll, Allow: []string{"api.openai.com", "*.example.com"}}
	for h, want := range map[string]string{
		"api.openai.com:Authorization=Bearer ${secret:openai}": "",
		"API.openai.com.:x-api-key=${secret:k}":                "",
		"*.example.com:X-Team=blue":                            "",
		"other.com:Authorization=x":                            "not an allowed name",
		"api.openai.com":                                       "HOST:NAME=VALUE",
		"api.openai.com:Authorization":                         "HOST:NAME=VALUE",
		"203.0.113.1:Authorization=x":                          "not an address",
		"api.openai.com:Host=evil":                             "keeps Host",
		"api.openai.com:Content-Length=0":                      "keeps Content-Length",
		"api.openai.com:Bad Name=x":                            "not a header name",
		"api.openai.com:A=${secret:Bad/Name}":                  "secret name",
		"api.openai.com:A=${env:HOME}":                         "${secret:NAME}",
	} {
		s := base
		s.Headers = []string{h}
		p, err := s.Policy()
		if want == "" {
			if err != nil || len(p.Headers) != 1 {
				t.Errorf("%q: %v", h, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want %q", h, err, want)
		}
	}
	p, _ := Spec{Mode: DenyAll, Allow: []string{"api.openai.com"}, Headers: []string{"api.openai.com:authorization=Bearer ${secret:openai}"}}.Policy()
	if h := p.Headers[0]; h.Name != "Authorization" || h.Value != "Bearer ${secret:openai}" {
		t.Errorf("header %+v", h)
	}
	if len(p.HeadersFor("api.openai.com")) != 1 || len(p.HeadersFor("x.api.openai.com")) != 0 {
		t.Error("HeadersFor")
	}
	// E2B's choice of a rule: exact first, then the longest wildcard; never
	// a merge. A header's host need only meet an allowed name.
	q, err := Spec{Mode: DenyAll, Allow: []string{"*.example.com"}, Headers: []string{
		"*.example.com:A=wide", "*.api.example.com:A=narrow", "*.api.example.com:B=narrow",
		"v1.api.example.com:A=exact"}}.Policy()
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]string{"x.example.com": "A=wide", "x.api.example.com": "A=narrow B=narrow",
		"V1.api.example.com.": "A=exact", "example.com": "", "api.example.com": "A=wide"} {
		var got []string
		for _, h := range q.HeadersFor(host) {
			got = append(got, h.Name+"="+h.Value)
		}
		if strings.Join(got, " ") != want {
			t.Errorf("HeadersFor(%s): %q, want %q", host, got, want)
		}
	}
	// Where not every address is denied a header would go unset: refused.
	if _, err := (Spec{Deny: []string{"203.0.113.0/24"}, Allow: []string{"api.openai.com"}, Headers: []string{"api.openai.com:A=x"}}).Policy(); err == nil || !strings.Contains(err.Error(), "deny-all") {
		t.Errorf("a header without deny-all: %v", err)
	}
	for _, c := range []struct {
		a, b string
		want bool
	}{{"a.x", "a.x", true}, {"a.x", "b.x", false}, {"*.x", "a.x", true}, {"a.x", "*.x", true}, {"*.a.x", "*.x", true},
		{"*.x", "*.a.x", true}, {"*.a.x", "*.b.x", false}, {"*.x", "x", false}} {
		if got := nameOf(c.a).overlaps(nameOf(c.b)); got != c.want {
			t.Errorf("%s overlaps %s: %v", c.a, c.b, got)
		}
	}
	// A policy whose header's host is no longer allowed is refused.
	p.Allow = nil
	if err := p.Validate(); err == nil {
		t.Error("a header for a name not allowed passed")
	}
}

func TestSecretsStore(t *testing.T) {
	root := t.TempDir()
	for _, bad := range []struct{ name, value string }{{"Bad", "x"}, {"a/b", "x"}, {"ok", ""}, {"ok", "\n"}, {"ok", "a\nb"}, {"ok", "a\x00"}} {
		if err := SetSecret(root, bad.name, []byte(bad.value)); err == nil {
			t.Errorf("SetSecret(%q, %q) passed", bad.name, bad.value)
		}
	}
	if err := SetSecret(root, "openai", []byte("sk-1\n")); err != nil {
		t.Fatal(err)
	}
	if v, err := Secret(root, "openai"); err != nil || v != "sk-1" {
		t.Fatalf("Secret: %q %v", v, err)
	}
	fi, _ := os.Stat(filepath.Join(root, "egress", "secrets", "openai"))
	di, _ := os.Stat(filepath.Join(root, "egress", "secrets"))
	if fi.Mode().Perm() != 0o600 || di.Mode().Perm() != 0o700 {
		t.Errorf("modes %v %v", fi.Mode(), di.Mode())
	}
	h := Header{Value: "Bearer ${secret:openai} ${secret:openai}"}
	if v, err := h.Resolve(root); err != nil || v != "Bearer sk-1 sk-1" {
		t.Errorf("Resolve: %q %v", v, err)
	}
	if _, err := (Header{Value: "${secret:none}"}).Resolve(root); err == nil {
		t.Error("a missing secret resolved")
	}
}
