package serve

import (
	"crypto/subtle"
	"net/http"
	"strconv"
	"time"

	"kvbox.dev/kvbox/guest-agent/envd"
)

// expiredMsg is envd's answer to a signed URL past its expiration, which
// E2B's SDK tests read.
const expiredMsg = "signature is already expired"

// expiredSignature says a /files request that no sandbox's token
// authorizes is signed with one's, only past its expiration: refused all
// the same, with envd's words for it (envd checks the signature first,
// then the expiration, so only a URL a sandbox signed hears it).
func (s *Server) expiredSignature(r *http.Request) bool {
	q := r.URL.Query()
	sig, e := q.Get("signature"), q.Get("signature_expiration")
	if sig == "" || e == "" {
		return false
	}
	exp, err := strconv.ParseInt(e, 10, 64)
	if err != nil || time.Now().Unix() <= exp {
		return false
	}
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	for _, rec := range s.secrets.all() {
		want := envd.Signature(q.Get("path"), op, q.Get("username"), rec.AccessToken, exp)
		if subtle.ConstantTimeCompare([]byte(sig), []byte(want)) == 1 {
			return true
		}
	}
	return false
}
