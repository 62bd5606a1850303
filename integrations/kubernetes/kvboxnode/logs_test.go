package kvboxnode

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
)

// kubectl logs -f of a pod without a command follows its box's console
// from where it was read: a line printed later arrives, and the console
// is read once in all, never again from its start.
func TestConsoleFollowReadsOnce(t *testing.T) {
	lib := newFakeLib()
	lib.console = filepath.Join(t.TempDir(), "console.log")
	start := strings.Repeat("boot line\n", 64<<10/10)
	if err := os.WriteFile(lib.console, []byte(start), 0o600); err != nil {
		t.Fatal(err)
	}
	p, cancel := testProvider(t, lib, &apiPods{pods: map[string]*corev1.Pod{}})
	defer cancel()
	pod := testPod("web", "u1")
	if err := p.CreatePod(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, p, "web", ready)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	rc, err := p.GetContainerLogs(ctx, "team", "web", "box", api.ContainerLogOpts{Follow: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	br := bufio.NewReader(rc)
	for i := 0; i < len(start)/10; i++ {
		if l, err := br.ReadString('\n'); err != nil || l != "boot line\n" {
			t.Fatalf("line %d of the console: %q, %v", i, l, err)
		}
	}
	// Lines printed after the first read arrive, one after another.
	f, err := os.OpenFile(lib.console, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var later int
	for i := 0; i < 3; i++ {
		line := "printed later " + string(rune('a'+i)) + "\n"
		later += len(line)
		f.WriteString(line)
		if l, err := br.ReadString('\n'); err != nil || l != line {
			t.Fatalf("followed: %q, %v; want %q", l, err, line)
		}
	}
	if n := lib.consoleRead.Load(); n != int64(len(start)+later) {
		t.Errorf("the follow read %d bytes of a console of %d: it read it again", n, len(start)+later)
	}
}
