package spec

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"kvbox.dev/kvbox/testenv/gate"
)

// The committed Go code is what generate.sh makes of the .proto files.
func TestGeneratedCode(t *testing.T) {
	gate.Tools(t, "protoc")
	out := t.TempDir()
	cmd := exec.Command("./generate.sh", out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("generate.sh: %v\n%s", err, b)
	}
	for _, f := range []string{
		"process/process.pb.go", "process/processconnect/process.connect.go",
		"filesystem/filesystem.pb.go", "filesystem/filesystemconnect/filesystem.connect.go",
	} {
		want, err := os.ReadFile(filepath.Join(out, f))
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is not what generate.sh makes of the .proto files: run guest-agent/envd/spec/generate.sh and commit the result", f)
		}
	}
}
