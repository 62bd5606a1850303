package image

import (
	"os/exec"
	"strings"
	"testing"
)

// TestCodeInterpServer runs the code-interpreter server's own unit tests
// (image/codeinterp/test_codeinterp.py: NDJSON lines, contexts, the HTTP
// contract against a fake kernel) with the host's python3; they need no
// Jupyter package.
func TestCodeInterpServer(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3 on this host")
	}
	cmd := exec.Command(py, "-B", "-W", "ignore::ResourceWarning", "-m", "unittest", "-v", "test_codeinterp")
	cmd.Dir = "codeinterp"
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python3 -m unittest test_codeinterp: %v\n%s", err, out)
	}
	t.Logf("%s", strings.TrimSpace(string(out)))
}

// TestCodeInterpRecipe: the code-interpreter image is its own recipe (a
// change to its server rebuilds it), the other images' recipes unchanged.
func TestCodeInterpRecipe(t *testing.T) {
	plain, ci := DebianRecipe(DebianOptions{}), DebianRecipe(DebianOptions{Name: CodeInterpreterImage, CodeInterpreter: true})
	if plain == ci {
		t.Fatal("the code interpreter's recipe is the plain image's")
	}
	saved := codeInterpServer
	defer func() { codeInterpServer = saved }()
	codeInterpServer += "\n# changed\n"
	if DebianRecipe(DebianOptions{Name: CodeInterpreterImage, CodeInterpreter: true}) == ci {
		t.Fatal("a change to the server left the recipe as it was")
	}
	if DebianRecipe(DebianOptions{}) != plain {
		t.Fatal("the plain image's recipe depends on the code interpreter's server")
	}
}
