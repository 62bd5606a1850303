package domain

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// qemuPID is the pid of a running box's QEMU from libvirt's pid file,
// checked against the process's command line (guest=NAME,) so that a pid
// reused by another process is never taken for it; 0 if there is none.
func qemuPID(name string) int {
	if strings.ContainsAny(name, "/\x00") {
		return 0
	}
	b, err := os.ReadFile(filepath.Join(qemuPidDir, name+".pid"))
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return 0
	}
	cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmd), "guest="+QemuOptEscape(name)+",") {
		return 0
	}
	return pid
}
