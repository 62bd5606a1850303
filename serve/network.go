package serve

import (
	"encoding/json"
	"net/http"

	"kvbox.dev/kvbox/egress"
)

// A sandbox's egress, in E2B's words (network.allowOut and denyOut at
// create, PUT /sandboxes/{id}/network while it runs), is a kvbox egress
// policy (package egress: allow beats deny, names only where addresses are
// denied, *.x for subdomains), kept in the box's definition and enforced on
// the host. allowInternetAccess false with rules is deny-all plus them.

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
	s := string(m)
	return len(m) > 0 && s != "null" && s != "{}" && s != "[]"
}

// policy is n's egress policy, nil when n names no rule (the sandbox is then
// as any box, or has no route out at all when noInternet); what kvbox cannot
// enforce is refused in one line.
func (n networkJSON) policy(noInternet bool) (*egress.Policy, error) {
	switch {
	case given(n.Rules):
		return nil, errorf(http.StatusBadRequest, "network rules (header transforms): kvbox serve does not take them yet; kvbox new --header with kvbox secrets does (docs/egress.md)")
	case given(n.EgressProxy):
		return nil, errorf(http.StatusBadRequest, "network egressProxy: kvbox serve tunnels through no proxy of yours")
	}
	if len(n.AllowOut) == 0 && len(n.DenyOut) == 0 {
		return nil, nil
	}
	spec := egress.Spec{Allow: n.AllowOut, Deny: n.DenyOut}
	if noInternet {
		spec.Mode = egress.DenyAll
	}
	p, err := spec.Policy()
	if err != nil {
		return nil, errorf(http.StatusBadRequest, "network: %v", err)
	}
	return &p, nil
}

// updateNetwork serves PUT /sandboxes/{id}/network: the sandbox's whole
// egress policy replaced while it runs, for its new connections.
func (s *Server) updateNetwork(w http.ResponseWriter, r *http.Request, id string) error {
	var n networkJSON
	if e := decodeBody(w, r, &n, true); e != nil {
		return e
	}
	noInternet := n.AllowInternetAccess != nil && !*n.AllowInternetAccess
	p, err := n.policy(noInternet)
	if err != nil {
		return err
	}
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
	return s.withSandbox(r.Context(), id, func(b Box, _ record) error {
		if b.NoInternet {
			return errorf(http.StatusConflict, "sandbox %s was made with allow_internet_access false and no rules: it has no route out, which no update changes (make it with denyOut 0.0.0.0/0 and allowOut rules instead)", id)
		}
		if err := s.host.SetEgress(r.Context(), id, *p); err != nil {
			return err
		}
		s.logf("sandbox %s: egress policy replaced (%d allowed, %d denied)", id, len(p.Allow), len(p.Deny))
		w.WriteHeader(http.StatusNoContent)
		return nil
	})
}
