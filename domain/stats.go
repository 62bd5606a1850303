package domain

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"time"

	"kvbox.dev/kvbox/base"
)

// CPUTime is the CPU time box name's QEMU used since it started, all its
// vCPUs and its own threads.
func (h *Host) CPUTime(name string) (time.Duration, error) {
	d, err := h.Conn().LookupDomainByName(name)
	if err != nil {
		return 0, base.Errorf(base.NotFound, "box %q: %s", name, LibvirtMessage(err))
	}
	defer d.Free()
	info, err := d.GetInfo()
	if err != nil {
		return 0, fmt.Errorf("box %q: %s", name, LibvirtMessage(err))
	}
	return time.Duration(info.CpuTime), nil
}

// QEMUMemory is what box name's running QEMU holds in RAM (its
// smaps_rollup): anon, its anonymous pages, are the box's own (what the
// guest wrote, QEMU's heap); the rest of rss is file pages it maps, a
// clone's snapshot's page cache, which its siblings share.
func QEMUMemory(name string) (rss, anon int64, err error) {
	pid := qemuPID(name)
	if pid == 0 {
		return 0, 0, base.Errorf(base.Unavailable, "box %q: its QEMU is not running", name)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return 0, 0, err
	}
	rss, anon = smapsRollup(b)
	return rss, anon, nil
}

// smapsRollup reads Rss and Anonymous (kB) out of a smaps_rollup file, in
// bytes.
func smapsRollup(b []byte) (rss, anon int64) {
	for _, line := range bytes.Split(b, []byte("\n")) {
		f := bytes.Fields(line)
		if len(f) != 3 || string(f[2]) != "kB" {
			continue
		}
		v, err := strconv.ParseInt(string(f[1]), 10, 64)
		if err != nil {
			continue
		}
		switch string(f[0]) {
		case "Rss:":
			rss = v << 10
		case "Anonymous:":
			anon = v << 10
		}
	}
	return rss, anon
}
