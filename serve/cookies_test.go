package serve

import (
	"net/http"
	"slices"
	"strings"
	"testing"
)

// A sandbox's app sets cookies on its own host only: a Set-Cookie whose
// Domain is serve's domain, a parent of it, or any host but the
// sandbox's own of that port loses that attribute (the cookie becomes
// host-only); one without it, or with the sandbox's own host, passes as it
// is. Else a browser would send it to every other sandbox.
func TestCookiesStayOnTheSandboxHost(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	sb := create(t, ts, `{"templateID":"warm"}`)
	own := "8000-" + sb.ID + ".kvbox.localhost"
	cases := []struct{ set, want string }{
		{"a=1; Domain=kvbox.localhost; Path=/", "a=1; Path=/"},
		{"b=2; domain=.KVBOX.LocalHost", "b=2"},
		{"c=3; Path=/; HttpOnly", "c=3; Path=/; HttpOnly"},
		{"d=4; Domain=" + own + "; Secure", "d=4; Domain=" + own + "; Secure"},
		{"e=5; Domain=.8000-" + strings.ToUpper(sb.ID) + ".kvbox.localhost", "e=5; Domain=.8000-" + strings.ToUpper(sb.ID) + ".kvbox.localhost"},
		{"f=6; Domain=localhost", "f=6"},
		{"g=7; Path=/; Domain=8000-zzzzzzzzzzzzzzzzzzzz.kvbox.localhost", "g=7; Path=/"},
		{"h=8; Domain=3000-" + sb.ID + ".kvbox.localhost; SameSite=Lax", "h=8; SameSite=Lax"},
		{"i=9; Domain=kvbox.localhost.", "i=9"},
	}
	h.handle("127.0.0.1:8000", func(w http.ResponseWriter, r *http.Request) {
		for _, c := range cases {
			w.Header().Add("Set-Cookie", c.set)
		}
	})
	var want []string
	for _, c := range cases {
		want = append(want, c.want)
	}
	for _, route := range [][]string{
		{"Host: " + own + ":3049"},
		{hdrSandboxID + ": " + sb.ID, hdrSandboxPort + ": 8000"},
	} {
		status, body, hdr := call(t, ts, "GET", "/", "", route...)
		if status != http.StatusOK {
			t.Fatalf("%v: %d %s", route, status, body)
		}
		if got := hdr.Values("Set-Cookie"); !slices.Equal(got, want) {
			t.Errorf("%v: Set-Cookie\n%q\nwant\n%q", route, got, want)
		}
	}
}
