package domain

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

const inheritChildEnv = "KVBOX_TEST_INHERIT_CHILD"

// A descriptor kvbox inherited open reaches no child kvbox starts after
// CloseInheritedOnExec; without it, the child holds it.
func TestCloseInheritedOnExec(t *testing.T) {
	if mode := os.Getenv(inheritChildEnv); mode != "" {
		if mode == "fix" {
			if err := CloseInheritedOnExec(); err != nil {
				t.Fatal(err)
			}
		}
		out, err := exec.Command("sh", "-c", `if test -e /proc/$$/fd/3; then echo open; else echo closed; fi`).Output()
		if err != nil {
			t.Fatal(err)
		}
		os.Stdout.WriteString("child's fd 3: " + string(out))
		return
	}
	f, err := os.CreateTemp(t.TempDir(), "held")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for mode, want := range map[string]string{"fix": "closed", "none": "open"} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestCloseInheritedOnExec$", "-test.v")
		cmd.Env = append(os.Environ(), inheritChildEnv+"="+mode)
		cmd.ExtraFiles = []*os.File{f} // fd 3 in kvbox, not close-on-exec
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "child's fd 3: "+want) {
			t.Errorf("%s: want the grandchild's fd 3 %s: %v\n%s", mode, want, err, out)
		}
	}
}
