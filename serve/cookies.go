package serve

import (
	"net/http"
	"strconv"
	"strings"
)

// ownCookies is the ModifyResponse of a sandbox's port: a Set-Cookie whose
// Domain attribute names any host but the sandbox's own for that port
// (<port>-<id>.<domain>) loses the attribute, which makes the cookie
// host-only: a browser sends it back to the host that set it alone. As it
// was, an app's cookie for serve's domain (or a parent of it) went with
// every request to every other sandbox, and to serve's API. A cookie
// without a Domain is host-only already and passes as it is.
func (s *Server) ownCookies(id string, port int) func(*http.Response) error {
	own := strconv.Itoa(port) + "-" + id + "." + stripPort(strings.ToLower(s.cfg.Domain))
	return func(resp *http.Response) error {
		lines := resp.Header.Values("Set-Cookie")
		if len(lines) == 0 {
			return nil
		}
		out := make([]string, len(lines))
		for i, l := range lines {
			out[i] = hostOnly(l, own)
		}
		resp.Header["Set-Cookie"] = out
		return nil
	}
}

// hostOnly is Set-Cookie line l without its Domain attributes but one that
// names own. The attributes are split at ';', which neither a cookie's
// value nor an attribute's may hold (RFC 6265); the rest is kept byte for
// byte.
func hostOnly(l, own string) string {
	parts := strings.Split(l, ";")
	keep := []string{parts[0]}
	for _, p := range parts[1:] {
		name, val, _ := strings.Cut(p, "=")
		if strings.EqualFold(strings.TrimSpace(name), "domain") {
			d := strings.ToLower(strings.TrimSpace(val))
			if strings.Trim(d, ".") != own {
				continue
			}
		}
		keep = append(keep, p)
	}
	return strings.Join(keep, ";")
}
