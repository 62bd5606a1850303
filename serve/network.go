package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/textproto"
	"regexp"
	"slices"
	"strings"

	"kvbox.dev/kvbox/egress"
)

// A sandbox's egress, in E2B's words (network.allowOut, denyOut and rules
// at create, PUT /sandboxes/{id}/network while it runs), is a kvbox egress
// policy (package egress: allow beats deny, names only where addresses are
// denied, *.x for subdomains), kept in the box's definition and enforced on
// the host. allowInternetAccess false with rules is deny-all plus them.
//
// network.rules[HOST] are header transforms, set by kvbox's egress proxy
// on the sandbox's HTTPS requests to HOST (E2B's choice of a rule: an exact
// host first, then the longest wildcard; never two merged). A header value
// reaches the definition only as references to the host's secret store:
// ${e2b.secrets.NAME} becomes a reference to the tenant's secret NAME
// (e2bsecrets.go), and every other run of the value (the "Bearer " before
// it, or a whole literal token, as E2B's SDK sends a value resolved on the
// client) becomes a secret of the sandbox's own, kept in serve's record of
// it and in the store, removed with the sandbox or when an update drops
// it. Nothing of a value is in the definition, a snapshot or a response.

// networkJSON is what both E2B calls send of a sandbox's egress.
type networkJSON struct {
	AllowOut            []string        `json:"allowOut"`
	DenyOut             []string        `json:"denyOut"`
	Rules               json.RawMessage `json:"rules"`
	EgressProxy         json.RawMessage `json:"egressProxy"`
	AllowInternetAccess *bool           `json:"allow_internet_access"`
}

// given says a raw field holds something (not absent, null or empty).
func given(m json.RawMessage) bool {
	s := string(bytes.TrimSpace(m))
	return len(s) > 0 && s != "null" && s != "{}" && s != "[]"
}

// ruleJSON is one of E2B's network rules.
type ruleJSON struct {
	Transform *struct {
		Headers map[string]string `json:"headers"`
	} `json:"transform"`
}

// egressPlan is a sandbox's egress as serve sets it: the policy, and the
// values of the sandbox's own header secrets it names (store name: value).
type egressPlan struct {
	policy  *egress.Policy
	secrets map[string]string
}

// plan is n's egress for sandbox id of tenant: policy nil when n names no
// rule (the sandbox is then as any box, or has no route out at all when
// noInternet); what kvbox cannot enforce is refused in one line.
func (s *Server) plan(n networkJSON, noInternet bool, tenant, id string) (egressPlan, error) {
	if given(n.EgressProxy) {
		return egressPlan{}, errorf(http.StatusBadRequest, "network egressProxy: kvbox serve tunnels through no proxy of yours")
	}
	headers, secrets, err := s.ruleHeaders(n.Rules, tenant, id)
	if err != nil {
		return egressPlan{}, err
	}
	if len(n.AllowOut) == 0 && len(n.DenyOut) == 0 && len(headers) == 0 {
		return egressPlan{}, nil
	}
	spec := egress.Spec{Allow: n.AllowOut, Deny: n.DenyOut}
	if noInternet {
		spec.Mode = egress.DenyAll
	}
	p, err := spec.Policy()
	if err != nil {
		return egressPlan{}, errorf(http.StatusBadRequest, "network: %v", err)
	}
	p.Headers = headers
	if err := p.Validate(); err != nil {
		hint := ""
		if m := err.Error(); strings.Contains(m, "allowed name") || strings.Contains(m, "deny-all") {
			hint = " (in E2B's words: a rule's host must be allowed by name in allowOut, and denyOut hold 0.0.0.0/0 or allowInternetAccess be false: kvbox's proxy sees no other request)"
		}
		return egressPlan{}, errorf(http.StatusBadRequest, "network rules: %v%s", err, hint)
	}
	return egressPlan{policy: &p, secrets: secrets}, nil
}

// placeholder is a ${...} of a header value.
var placeholder = regexp.MustCompile(`\$\{([^}]*)\}`)

// ruleHeaders are E2B's rules as header transforms for sandbox id, and
// the values of the sandbox's own secrets they name.
func (s *Server) ruleHeaders(raw json.RawMessage, tenant, id string) ([]egress.Header, map[string]string, error) {
	if !given(raw) {
		return nil, nil, nil
	}
	var rules map[string][]ruleJSON
	if err := json.Unmarshal(raw, &rules); err != nil {
		return nil, nil, errorf(http.StatusBadRequest, "network rules: give {HOST: [{transform: {headers: {NAME: VALUE}}}]} (%v)", err)
	}
	suffix := newSuffix()
	secrets := map[string]string{}
	var out []egress.Header
	for _, key := range slices.Sorted(maps.Keys(rules)) {
		host, err := egress.NameRule(key)
		if err != nil {
			return nil, nil, errorf(http.StatusBadRequest, "network rules[%q]: a rule's key is a host name or *.name: %v", key, err)
		}
		for _, rule := range rules[key] {
			if rule.Transform == nil {
				continue
			}
			for _, name := range slices.Sorted(maps.Keys(rule.Transform.Headers)) {
				v, err := s.headerValue(rule.Transform.Headers[name], tenant, func(lit string) string {
					n := fmt.Sprintf("e2bh-%s.%s-%d", id, suffix, len(secrets)+1)
					secrets[n] = lit
					return n
				})
				if err != nil {
					return nil, nil, fmt.Errorf("network rules[%q] header %s: %w", key, name, err)
				}
				out = append(out, egress.Header{Host: host, Name: textproto.CanonicalMIMEHeaderKey(name), Value: v})
			}
		}
	}
	if len(out) > egress.MaxRules {
		return nil, nil, errorf(http.StatusBadRequest, "network rules: %d headers, at most %d", len(out), egress.MaxRules)
	}
	return out, secrets, nil
}

// headerValue is value as references to the store only: its
// ${e2b.secrets.NAME} the tenant's secret NAME, every other run a secret
// of the sandbox's own (literal names it). The value is never quoted in an
// error.
func (s *Server) headerValue(value, tenant string, literal func(string) string) (string, error) {
	if err := checkSecretValue(value); err != nil {
		return "", err
	}
	var b strings.Builder
	at := 0
	lit := func(to int) {
		if to > at {
			b.WriteString("${secret:" + literal(value[at:to]) + "}")
		}
	}
	for _, m := range placeholder.FindAllStringSubmatchIndex(value, -1) {
		lit(m[0])
		at = m[1]
		inner := value[m[2]:m[3]]
		name, ok := strings.CutPrefix(inner, "e2b.secrets.")
		switch {
		case strings.HasPrefix(inner, "e2b.identity."):
			return "", errorf(http.StatusBadRequest, "${%s}: kvbox serve issues no IAM tokens", inner)
		case !ok:
			return "", errorf(http.StatusBadRequest, "${%s}: a value names a secret only as ${e2b.secrets.NAME} (Secret.fill)", inner)
		}
		c, err := checkSecretName(name)
		if err != nil {
			return "", err
		}
		has, err := s.hasSecret(tenant, c)
		if err != nil {
			return "", err
		}
		if !has {
			return "", errorf(http.StatusBadRequest, "secret %s not found (Secret.create makes it)", c)
		}
		b.WriteString("${secret:" + storeName(tenant, c) + "}")
	}
	if strings.Contains(value[at:], "${") {
		return "", errorf(http.StatusBadRequest, "a ${ without its }: a value names a secret only as ${e2b.secrets.NAME}")
	}
	lit(len(value))
	return b.String(), nil
}

// putSecrets puts a sandbox's own header secrets in the host's store; on
// failure, none of them stays.
func (s *Server) putSecrets(m map[string]string) error {
	for _, n := range slices.Sorted(maps.Keys(m)) {
		if err := s.host.SetSecret(n, []byte(m[n])); err != nil {
			s.dropSecrets(m, nil)
			return fmt.Errorf("keep a header secret of the sandbox: %w", err)
		}
	}
	return nil
}

// dropSecrets removes the secrets of m that keep does not hold.
func (s *Server) dropSecrets(m, keep map[string]string) {
	for n := range m {
		if _, ok := keep[n]; ok {
			continue
		}
		if err := s.host.RemoveSecret(n); err != nil && !errors.Is(err, ErrNotFound) {
			s.logf("header secret %s: not removed: %v", n, err)
		}
	}
}

// forkPlan is the egress of a fork of the sandbox of rec: its policy, the
// parent's own header secrets copied under the fork's id (the parent's go
// with it). nil policy: the fork's snapshot's.
func forkPlan(rec record, id string) egressPlan {
	if rec.Egress == nil {
		return egressPlan{}
	}
	p := *rec.Egress
	p.Headers = slices.Clone(p.Headers)
	suffix := newSuffix()
	secrets := map[string]string{}
	for _, old := range slices.Sorted(maps.Keys(rec.HeaderSecrets)) {
		n := fmt.Sprintf("e2bh-%s.%s-%d", id, suffix, len(secrets)+1)
		secrets[n] = rec.HeaderSecrets[old]
		for i := range p.Headers {
			p.Headers[i].Value = strings.ReplaceAll(p.Headers[i].Value, "${secret:"+old+"}", "${secret:"+n+"}")
		}
	}
	return egressPlan{policy: &p, secrets: secrets}
}

// updateNetwork serves PUT /sandboxes/{id}/network: the sandbox's whole
// egress policy, rules included, replaced while it runs, for its new
// connections.
func (s *Server) updateNetwork(w http.ResponseWriter, r *http.Request, id string) error {
	var n networkJSON
	if e := decodeBody(w, r, &n, true); e != nil {
		return e
	}
	noInternet := n.AllowInternetAccess != nil && !*n.AllowInternetAccess
	return s.withSandbox(r.Context(), id, func(b Box, rec record) error {
		if b.NoInternet {
			return errorf(http.StatusConflict, "sandbox %s was made with allow_internet_access false and no rules: it has no route out, which no update changes (make it with denyOut 0.0.0.0/0 and allowOut rules instead)", id)
		}
		pl, err := s.plan(n, noInternet, tenantOf(r), id)
		if err != nil {
			return err
		}
		p := pl.policy
		if p == nil {
			p = &egress.Policy{}
			if noInternet {
				all, err := egress.Spec{Mode: egress.DenyAll}.Policy()
				if err != nil {
					return err
				}
				p = &all
			}
		}
		if err := s.setEgress(r.Context(), id, rec, egressPlan{policy: p, secrets: pl.secrets}); err != nil {
			return err
		}
		s.logf("sandbox %s: egress policy replaced (%d allowed, %d denied, %d headers)", id, len(p.Allow), len(p.Deny), len(p.Headers))
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}

// setEgress makes pl sandbox id's egress (rec its record): the new header
// secrets first, then the policy, then the record; the old secrets go
// once nothing names them. On failure the sandbox keeps what it had.
func (s *Server) setEgress(ctx context.Context, id string, rec record, pl egressPlan) error {
	if err := s.putSecrets(pl.secrets); err != nil {
		return err
	}
	if err := s.host.SetEgress(ctx, id, *pl.policy); err != nil {
		s.dropSecrets(pl.secrets, nil)
		return err
	}
	old := rec.HeaderSecrets
	rec.Egress, rec.HeaderSecrets = pl.policy, pl.secrets
	if pl.policy.IsZero() {
		rec.Egress = nil
	}
	if err := s.secrets.put(rec); err != nil {
		// The policy is in force; the next update or the sandbox's end
		// removes what the record does not name.
		return err
	}
	s.dropSecrets(old, pl.secrets)
	return nil
}
