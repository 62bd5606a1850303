package qmp

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// KVMEnabled reports whether QEMU runs the guest with KVM; false means
// TCG, QEMU's own CPU emulator.
func (c *Client) KVMEnabled(ctx context.Context) (bool, error) {
	var r struct {
		Enabled bool `json:"enabled"`
	}
	err := c.Execute(ctx, "query-kvm", nil, &r)
	return r.Enabled, err
}

// ObjectType is the QOM type of the object at path, like
// "memory-backend-ram" for /objects/ID.
func (c *Client) ObjectType(ctx context.Context, path string) (string, error) {
	var t string
	err := c.Execute(ctx, "qom-get", map[string]any{"path": path, "property": "type"}, &t)
	return t, err
}

// RAMBlockOffset is where QEMU placed the named RAM block in its RAM
// address space (HMP "info ramblock": QMP has no command for it); ok is
// false when QEMU has no such block.
func (c *Client) RAMBlockOffset(ctx context.Context, name string) (offset uint64, ok bool, err error) {
	var out string
	if err := c.Execute(ctx, "human-monitor-command", map[string]any{"command-line": "info ramblock"}, &out); err != nil {
		return 0, false, err
	}
	return parseRAMBlockOffset(out, name)
}

// parseRAMBlockOffset reads a block's offset from "info ramblock":
//
//	Block Name    PSize              Offset               Used ...
//	 kvbox.ram    4 KiB  0x0000000000000000 0x0000000020000000 ...
func parseRAMBlockOffset(out, name string) (uint64, bool, error) {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || f[0] != name {
			continue
		}
		v, err := strconv.ParseUint(strings.TrimPrefix(f[3], "0x"), 16, 64)
		if err != nil {
			return 0, false, fmt.Errorf("info ramblock: the offset of %s: %q", name, line)
		}
		return v, true, nil
	}
	return 0, false, nil
}
