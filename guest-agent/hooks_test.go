package agent

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestHookNamesAndRun(t *testing.T) {
	dir := t.TempDir()
	for name, mode := range map[string]os.FileMode{
		"20-b": 0o755, "10-a": 0o700, ".hidden": 0o755, "30-c~": 0o755, "40-noexec": 0o644,
	} {
		os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\nexit 0\n"), mode)
	}
	os.Mkdir(filepath.Join(dir, "50-dir"), 0o755)
	os.Symlink("10-a", filepath.Join(dir, "15-link"))
	got, err := hookNames(dir)
	if want := []string{"10-a", "15-link", "20-b"}; err != nil || !slices.Equal(got, want) {
		t.Errorf("hookNames = %q, %v; want %q", got, err, want)
	}
	if got, err := hookNames(filepath.Join(dir, "missing")); err != nil || got != nil {
		t.Errorf("hookNames of a missing dir = %q, %v", got, err)
	}

	fail := filepath.Join(dir, "fail")
	os.WriteFile(fail, []byte("#!/bin/sh\necho boom\nexit 3\n"), 0o755)
	if err := runHook(fail, 5*time.Second); err == nil || err.Error() != "exit status 3" {
		t.Errorf("runHook of exit 3: %v", err)
	}
	slow := filepath.Join(dir, "slow")
	pidFile := filepath.Join(dir, "child.pid")
	os.WriteFile(slow, []byte("#!/bin/sh\nsleep 60 &\necho $! > "+pidFile+"\nsleep 60\n"), 0o755)
	start := time.Now()
	err = runHook(slow, 300*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "timed out after 300ms") || time.Since(start) > 5*time.Second {
		t.Errorf("runHook past its timeout: %v after %s", err, time.Since(start))
	}
	b, _ := os.ReadFile(pidFile)
	time.Sleep(100 * time.Millisecond)
	if pid := strings.TrimSpace(string(b)); pid != "" {
		if st, err := os.ReadFile("/proc/" + pid + "/stat"); err == nil && !strings.Contains(string(st), ") Z ") {
			t.Errorf("the hook's background child %s outlived the timeout", pid)
		}
	}
}
