package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestParsePortSpec(t *testing.T) {
	for in, want := range map[string]portSpec{
		"8080:8000":           {"127.0.0.1", 8080, 8000},
		"0.0.0.0:8080:8000":   {"0.0.0.0", 8080, 8000},
		"[::1]:2222:22":       {"::1", 2222, 22},
		"0:80":                {"127.0.0.1", 0, 80},
		"10.1.2.3:65535:1":    {"10.1.2.3", 65535, 1},
		"127.0.0.1:8081:8000": {"127.0.0.1", 8081, 8000},
	} {
		got, err := parsePortSpec(in)
		if err != nil || got != want {
			t.Errorf("%q: %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "8080", "8080:0", "8080:70000", "x:8080:80", "[::1:80:80", "a:b", "-1:80", "host.example:80:80"} {
		if _, err := parsePortSpec(in); !errors.Is(err, errUsage) {
			t.Errorf("%q: %v, want a usage error", in, err)
		}
	}
	if _, err := parsePortSpecs([]string{"8080:80", "127.0.0.1:8080:81"}); !errors.Is(err, errUsage) {
		t.Errorf("the same host port twice: %v", err)
	}
}

// holderAlive only takes a live process whose arguments are a port holder's
// for that box: a reused pid of anything else is not one.
func TestHolderAlive(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sleep 30", "port-forward", "--listen-fds", "box1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	// Start returns once the child is forked; its command line is the
	// test's own until it has exec'd sh.
	for i := 0; i < 200 && !strings.Contains(cmdline(pid), "box1"); i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if !holderAlive(pid, "box1") {
		t.Error("a live holder of box1 not recognised")
	}
	if holderAlive(pid, "box2") || holderAlive(os.Getpid(), "box1") || holderAlive(0, "box1") {
		t.Error("another process taken for a holder")
	}
	cmd.Process.Kill()
	cmd.Wait()
	if holderAlive(pid, "box1") {
		t.Error("a reaped holder is still alive")
	}
}

func cmdline(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return string(b)
}
