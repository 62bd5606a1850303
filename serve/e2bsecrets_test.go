package serve

import (
	"bytes"
	"encoding/json"
	"log"
	"maps"
	"slices"
	"strings"
	"testing"

	"kvbox.dev/kvbox/egress"
)

// E2B's secrets and network rules: Secret.create keeps a value in the
// host's store under the tenant's scope, a rule's ${e2b.secrets.NAME}
// names it there and every other run of a header value becomes a secret
// of the sandbox's own; the policy holds references only; another API key
// reaches none of it; an update replaces the rules, and the sandbox's own
// secrets go with the rules that named them, with the sandbox, and are
// copied into its forks.
func TestNetworkRulesAndSecrets(t *testing.T) {
	const value, literal = "sk-live-Qw7rT9", "tok-literal-83hd"
	h := newFakeHost()
	dir := t.TempDir()
	var logs bytes.Buffer
	_, ts := newTestServer(t, h, dir, func(c *Config) { c.Log = log.New(&logs, "", 0) })
	const keyB = "e2b_ffffffffffffffffffffffffffffffffffffffff"
	_, tsB := newTestServer(t, h, dir, func(c *Config) { c.APIKey = keyB })
	asB := "X-Api-Key: " + keyB
	var bodies []string
	seen := func(b string) string { bodies = append(bodies, b); return b }

	status, out, _ := call(t, ts, "POST", "/secrets", `{"name":"OpenAI","value":"`+value+`","metadata":{"team":"a"}}`)
	if status != 201 {
		t.Fatalf("Secret.create: %d %s", status, out)
	}
	var sec secretJSON
	json.Unmarshal([]byte(seen(out)), &sec)
	if sec.Name != "openai" || !strings.HasPrefix(sec.SecretID, "sec_") || sec.CurrentVersion != 1 || sec.Metadata["team"] != "a" {
		t.Errorf("Secret.create answered %s", out)
	}
	for name, body := range map[string]string{
		"the same name": `{"name":"openai","value":"x"}`, "no value": `{"name":"k2"}`,
		"a bad name": `{"name":"a b","value":"x"}`, "an id's prefix": `{"name":"sec_x","value":"x"}`,
		"a line break": `{"name":"k3","value":"a\nb"}`,
	} {
		if status, out, _ := call(t, ts, "POST", "/secrets", body); status/100 != 4 {
			t.Errorf("Secret.create, %s: %d %s", name, status, out)
		}
	}
	for _, id := range []string{"openai", "OPENAI", sec.SecretID} {
		if status, out, _ := call(t, ts, "GET", "/secrets/"+id, ""); status != 200 || !strings.Contains(seen(out), sec.SecretID) {
			t.Errorf("getInfo %s: %d %s", id, status, out)
		}
	}
	// The other tenant sees none of it, and has a secret of the same name
	// of its own.
	if status, out, _ := call(t, tsB, "GET", "/secrets", "", asB); status != 200 || strings.TrimSpace(out) != "[]" {
		t.Errorf("tenant B's list: %d %s", status, out)
	}
	if status, _, _ := call(t, tsB, "GET", "/secrets/"+sec.SecretID, "", asB); status != 404 {
		t.Errorf("tenant B's getInfo of A's secret: %d", status)
	}
	if status, out, _ := call(t, tsB, "POST", "/secrets", `{"name":"openai","value":"b-own"}`, asB); status != 201 {
		t.Fatalf("tenant B's own openai: %d %s", status, out)
	}
	if status, out, _ := call(t, ts, "POST", "/secrets", `{"name":"a-only","value":"a-only-value"}`); status != 201 {
		t.Fatalf("Secret.create a-only: %d %s", status, out)
	}
	store := h.storeOf()
	var scoped []string
	for n := range store {
		if strings.HasSuffix(n, ".openai") {
			scoped = append(scoped, n)
		}
	}
	if len(scoped) != 2 || scoped[0] == scoped[1] || !strings.HasSuffix(scoped[0], ".openai") {
		t.Fatalf("the store %v: want each tenant's openai apart", slices.Collect(maps.Keys(store)))
	}

	rules := `"rules":{"api.example.com":[{"transform":{"headers":{"authorization":"Bearer ${e2b.secrets.openai}"}}}],` +
		`"*.example.com":[{"transform":{"headers":{"X-Lit":"` + literal + `"}}}]}`
	a := create(t, ts, `{"templateID":"warm","network":{"allowOut":["api.example.com","*.example.com"],"denyOut":["0.0.0.0/0"],`+rules+`}}`)
	seen(mustJSON(t, a.JSON))
	policyOf := func(id string) *egress.Policy {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.boxes[id].egress
	}
	p := policyOf(a.ID)
	if p == nil || len(p.Headers) != 2 {
		t.Fatalf("a's policy %+v", p)
	}
	pj := mustJSON(t, p)
	if strings.Contains(pj, value) || strings.Contains(pj, literal) || strings.Contains(pj, "Bearer") {
		t.Fatalf("a header value in the policy: %s", pj)
	}
	// The proxy resolves them to the values given.
	resolve := func(v string) string {
		st := h.storeOf()
		return placeholder.ReplaceAllStringFunc(v, func(m string) string {
			return st[strings.TrimSuffix(strings.TrimPrefix(m, "${secret:"), "}")]
		})
	}
	for _, hd := range p.Headers {
		want := map[string]string{"Authorization": "Bearer " + value, "X-Lit": literal}[hd.Name]
		if got := resolve(hd.Value); got != want {
			t.Errorf("header %s resolves to %q, want %q", hd.Name, got, want)
		}
	}
	own := func(id string) []string {
		var out []string
		for n := range h.storeOf() {
			if strings.HasPrefix(n, "e2bh-"+id+".") {
				out = append(out, n)
			}
		}
		return out
	}
	if n := len(own(a.ID)); n != 2 {
		t.Errorf("a's own header secrets: %d, want 2 (\"Bearer \" and the literal)", n)
	}

	// What a tenant cannot name or kvbox cannot do is refused, nothing made.
	before := len(h.storeOf())
	for name, c := range map[string]struct {
		ts   string
		body string
	}{
		"another tenant's secret":  {"B", `"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"api.example.com":[{"transform":{"headers":{"A":"${e2b.secrets.nosuch}"}}}]}`},
		"the host store's name":    {"A", `"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"api.example.com":[{"transform":{"headers":{"A":"${secret:` + scoped[0] + `}"}}}]}`},
		"an IAM token":             {"A", `"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"api.example.com":[{"transform":{"headers":{"A":"${e2b.identity.tokens.aws}"}}}]}`},
		"a rule not allowed":       {"A", `"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"other.org":[{"transform":{"headers":{"A":"x"}}}]}`},
		"a rule without deny-all":  {"A", `"allowOut":["api.example.com"],"denyOut":["203.0.113.0/24"],"rules":{"api.example.com":[{"transform":{"headers":{"A":"x"}}}]}`},
		"a rule by address":        {"A", `"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"203.0.113.7":[{"transform":{"headers":{"A":"x"}}}]}`},
		"a header the proxy keeps": {"A", `"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"api.example.com":[{"transform":{"headers":{"Host":"x"}}}]}`},
	} {
		srv, hdr := ts, "X-Trace: 1"
		if c.ts == "B" {
			// B names A's secret by its name: B has none of it.
			c.body = strings.Replace(c.body, "nosuch", "a-only", 1)
			srv, hdr = tsB, asB
		}
		if status, out, _ := call(t, srv, "POST", "/v2/sandboxes", `{"templateID":"warm","network":{`+c.body+`}}`, hdr); status != 400 {
			t.Errorf("%s: %d %s, want 400", name, status, out)
		} else {
			t.Logf("%s: %s", name, strings.TrimSpace(seen(out)))
		}
	}
	if len(h.storeOf()) != before {
		t.Errorf("refused creates left secrets in the store")
	}

	// B's rule naming openai gets B's openai.
	bb := `{"templateID":"warm","network":{"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"api.example.com":[{"transform":{"headers":{"A":"${e2b.secrets.openai}"}}}]}}}`
	status, out, _ = call(t, tsB, "POST", "/v2/sandboxes", bb, asB)
	var bsb struct {
		SandboxID string `json:"sandboxID"`
	}
	if json.Unmarshal([]byte(out), &bsb); status != 201 {
		t.Fatalf("B's sandbox: %d %s", status, out)
	}
	if bp := policyOf(bsb.SandboxID); bp == nil || len(bp.Headers) != 1 || resolve(bp.Headers[0].Value) != "b-own" {
		t.Errorf("B's ${e2b.secrets.openai}: %+v", bp)
	}

	// A fork has its own copies of a's own secrets.
	status, out, _ = call(t, ts, "POST", "/sandboxes/"+a.ID+"/fork", `{"count":1}`)
	var forks []struct {
		Sandbox *struct {
			SandboxID string `json:"sandboxID"`
		} `json:"sandbox"`
	}
	if json.Unmarshal([]byte(seen(out)), &forks); status != 201 || len(forks) != 1 || forks[0].Sandbox == nil {
		t.Fatalf("fork: %d %s", status, out)
	}
	f := forks[0].Sandbox.SandboxID
	fp := policyOf(f)
	if fp == nil || len(own(f)) != 2 || strings.Contains(mustJSON(t, fp), "e2bh-"+a.ID) {
		t.Errorf("the fork's policy %+v, own secrets %v", fp, own(f))
	}

	// updateNetwork replaces the rules: the old own secrets go.
	old := own(a.ID)
	upd := `{"allowOut":["api.example.com"],"denyOut":["0.0.0.0/0"],"rules":{"api.example.com":[{"transform":{"headers":{"X-New":"n-` + literal + `"}}}]}}`
	if status, out, _ := call(t, ts, "PUT", "/sandboxes/"+a.ID+"/network", upd); status != 204 {
		t.Fatalf("updateNetwork: %d %s", status, out)
	}
	p = policyOf(a.ID)
	if len(p.Headers) != 1 || p.Headers[0].Name != "X-New" || resolve(p.Headers[0].Value) != "n-"+literal {
		t.Errorf("after the update: %+v", p.Headers)
	}
	for _, n := range old {
		if _, ok := h.storeOf()[n]; ok {
			t.Errorf("the update left %s", n)
		}
	}
	if status, _, _ := call(t, ts, "PUT", "/sandboxes/"+a.ID+"/network", `{}`); status != 204 || len(own(a.ID)) != 0 || !policyOf(a.ID).IsZero() {
		t.Errorf("an update without rules: %d, own %v", status, own(a.ID))
	}

	// A kill takes the sandbox's own secrets; the tenant's stay. A serve
	// started again still knows the record's.
	if status, _, _ := call(t, ts, "DELETE", "/sandboxes/"+f, ""); status != 204 || len(own(f)) != 0 {
		t.Errorf("kill of the fork: %d, own %v", status, own(f))
	}
	if status, out, _ := call(t, ts, "POST", "/secrets/openai", `{"value":"sk-rotated"}`); status != 200 || !strings.Contains(out, `"currentVersion":2`) {
		t.Errorf("Secret.update: %d %s", status, out)
	}
	if status, _, _ := call(t, ts, "DELETE", "/secrets/openai", ""); status != 204 {
		t.Errorf("Secret.destroy: %d", status)
	}
	if status, _, _ := call(t, ts, "DELETE", "/secrets/openai", ""); status != 404 {
		t.Errorf("Secret.destroy again: %d", status)
	}
	if _, ok := h.storeOf()[storeName(tenantOfKey(testKey), "openai")]; ok {
		t.Error("the destroyed secret is in the store")
	}
	if h.storeOf()[storeName(tenantOfKey(keyB), "openai")] != "b-own" {
		t.Error("tenant B's secret went with A's")
	}
	// No value is in any answer or in serve's log.
	bodies = append(bodies, logs.String())
	for _, b := range bodies {
		for _, v := range []string{value, literal, "sk-rotated"} {
			if strings.Contains(b, v) {
				t.Errorf("a secret value in %q", b)
			}
		}
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
