package agent

import (
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// constants reads string constants from the package's source, outside
// tests: those whose name match takes, by name.
func constants(t *testing.T, match func(name string) bool) map[string]string {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	consts := map[string]string{}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.CONST {
				continue
			}
			for _, spec := range g.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, id := range vs.Names {
					if !match(id.Name) {
						continue
					}
					lit, ok := vs.Values[i].(*ast.BasicLit)
					if !ok || lit.Kind != token.STRING {
						t.Fatalf("%s: %s is not a string literal: the test cannot read it", name, id.Name)
					}
					v, _ := strconv.Unquote(lit.Value)
					consts[id.Name] = v
				}
			}
		}
	}
	return consts
}

// methodConstants are the package's method names: every string constant
// named method..., which is what the package's client sends.
func methodConstants(t *testing.T) map[string]string {
	t.Helper()
	consts := constants(t, func(name string) bool { return strings.HasPrefix(name, "method") })
	if len(consts) == 0 {
		t.Fatal("no method constants found")
	}
	return consts
}

// The operations' table is the one place the agent learns its methods:
// every method the client sends is in it, nothing else is, and a method
// registered twice stops the agent. Served before authorization are ping
// and auth, and set-token checks for itself: any other method registered
// is authorized-only, so opening one is a change of this test.
func TestOpsTable(t *testing.T) {
	consts := methodConstants(t)
	for name, m := range consts {
		if _, ok := ops[m]; !ok {
			t.Errorf("%s (%q) is not a registered operation", name, m)
		}
	}
	for m := range ops {
		if !slices.Contains(slices.Collect(maps.Values(consts)), m) {
			t.Errorf("operation %q has no method constant", m)
		}
	}
	unguarded := map[string]access{methodPing: beforeAuth, methodAuth: beforeAuth, methodSetToken: ownCheck}
	for m, o := range ops {
		if o.access != unguarded[m] {
			t.Errorf("operation %q has access %d, want %d", m, o.access, unguarded[m])
		}
		if o.serve == nil {
			t.Errorf("operation %q has no handler", m)
		}
	}
	for m := range ops {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("registering %q twice did not panic", m)
				}
			}()
			maps.Clone(ops).add(m, authorizedOnly, (*session).ping)
		}()
	}
}

// remoteMessage is the agent's answer to a call of method with empty
// parameters ({}) on c, "" when it served it.
func remoteMessage(t *testing.T, c *Client, method string) string {
	t.Helper()
	err := c.call(tctx(t), method, struct{}{}, nil)
	var re *RemoteError
	if err != nil && !errors.As(err, &re) {
		t.Fatalf("%s: %v", method, err)
	}
	if re == nil {
		return ""
	}
	return re.Message
}

// session.request: an unauthorized session (untrusted, an agent without a
// token) is served ping and is refused everything else, registered or
// not (auth and set-token by their handlers); an authorized one is told which method the agent does not know, in
// the words hosts match.
func TestOpsDispatch(t *testing.T) {
	s := testServer(t)
	refused := serveUntrusted(t, s, nil)
	if _, err := refused.Ping(tctx(t)); err != nil {
		t.Fatalf("ping of an unauthorized session: %v", err)
	}
	for _, m := range append(slices.Sorted(maps.Keys(ops)), "x") {
		if m == methodPing {
			continue
		}
		if got := remoteMessage(t, refused, m); got != ErrUnauthorized.Error() {
			t.Errorf("%q on an unauthorized session: %q, want %q", m, got, ErrUnauthorized)
		}
	}
	// set-token decides for itself, after its parameters.
	var re *RemoteError
	if err := refused.call(tctx(t), methodSetToken, "not an object", nil); !errors.As(err, &re) || !strings.HasPrefix(re.Message, "bad token: ") {
		t.Errorf("a malformed set-token on an unauthorized session: %v, want bad token", err)
	}

	served := start(t, s)
	if got, want := remoteMessage(t, served, "x"), `unknown method "x"`; got != want {
		t.Errorf("an unknown method on an authorized session: %q, want %q", got, want)
	}
	if _, err := served.Ping(tctx(t)); err != nil {
		t.Errorf("ping of an authorized session: %v", err)
	}
}

// Every helper mode the package's client runs (an exec of selfArgv0 with a
// ...HelperArg) is registered, and nothing else: the agent's own flags are
// no helper.
func TestHelpers(t *testing.T) {
	args := constants(t, func(name string) bool { return strings.HasSuffix(name, "HelperArg") })
	if len(args) < 2 {
		t.Fatalf("helper arguments found: %v", args)
	}
	for name, arg := range args {
		if Helper(arg) == nil {
			t.Errorf("%s (%q) is not a registered helper", name, arg)
		}
	}
	if len(helpers) != len(args) {
		t.Errorf("%d helpers registered, %d helper arguments: %v", len(helpers), len(args), slices.Sorted(maps.Keys(helpers)))
	}
	for _, arg := range []string{"", "-state-dir", "--no-vsock", "ping"} {
		if Helper(arg) != nil {
			t.Errorf("argv[1] %q runs a helper", arg)
		}
	}
}
