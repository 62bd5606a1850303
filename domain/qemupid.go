package domain

import (
	"encoding/json"
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
	pid, _ := qemuProcess(name)
	return pid
}

// qemuProcess is qemuPID with the command line it was checked against,
// one argument each.
func qemuProcess(name string) (int, []string) {
	if strings.ContainsAny(name, "/\x00") {
		return 0, nil
	}
	b, err := os.ReadFile(filepath.Join(qemuPidDir, name+".pid"))
	if err != nil {
		return 0, nil
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return 0, nil
	}
	cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmd), "guest="+QemuOptEscape(name)+",") {
		return 0, nil
	}
	return pid, strings.Split(strings.TrimSuffix(string(cmd), "\x00"), "\x00")
}

// Blockdevs are the block nodes libvirt gave a running box's QEMU on its
// command line (-blockdev, in JSON), by node-name, each with the options
// it was opened with. A node added later (by a block job, a hot-plug) is
// not among them.
func Blockdevs(name string) (map[string]map[string]any, error) {
	pid, args := qemuProcess(name)
	if pid == 0 {
		return nil, fmt.Errorf("box %q: no running QEMU found", name)
	}
	return blockdevArgs(args), nil
}

// blockdevArgs picks the JSON -blockdev arguments out of a command line;
// the older key=value form is left out.
func blockdevArgs(args []string) map[string]map[string]any {
	nodes := map[string]map[string]any{}
	for i := 0; i+1 < len(args); i++ {
		if args[i] != "-blockdev" || !strings.HasPrefix(args[i+1], "{") {
			continue
		}
		var opts map[string]any
		if json.Unmarshal([]byte(args[i+1]), &opts) != nil {
			continue
		}
		if n, ok := opts["node-name"].(string); ok && n != "" {
			nodes[n] = opts
		}
	}
	return nodes
}
