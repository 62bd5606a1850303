package qmp

import "context"

// KVMEnabled reports whether QEMU runs the guest with KVM; false means
// TCG, QEMU's own CPU emulator.
func (c *Client) KVMEnabled(ctx context.Context) (bool, error) {
	var r struct {
		Enabled bool `json:"enabled"`
	}
	err := c.Execute(ctx, "query-kvm", nil, &r)
	return r.Enabled, err
}
