package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// FeatureReprobeBalloon: ReprobeBalloon.
const FeatureReprobeBalloon = "reprobe-balloon"

func init() {
	registerFeature(FeatureReprobeBalloon)
	registerOp(methodReprobeBalloon, authorizedOnly, (*session).reprobeBalloon)
}

const methodReprobeBalloon = "reprobe-balloon"

func (ss *session) reprobeBalloon(gen uint64, id uint32, _ json.RawMessage) {
	go func() { ss.reply(gen, id, nil, ss.srv.sys().ReprobeBalloon()) }()
}

// balloonDriver is where the guest's virtio balloon driver lists the devices
// it drives, and takes a device's name to let it go (unbind) or to drive it
// (bind).
const balloonDriver = "/sys/bus/virtio/drivers/virtio_balloon"

// ReprobeBalloon has the guest's balloon driver let its device go and take it
// again, so that it agrees on the device's features anew: a clone's balloon
// offers free page hints that its source's did not, and the driver only
// reads what a device offers when it takes it. Taking the device again
// deflates the balloon.
func (s *LinuxSystem) ReprobeBalloon() error {
	dir := s.path(balloonDriver)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("the guest's virtio balloon driver: %w", err)
	}
	var devs []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "virtio") {
			devs = append(devs, e.Name())
		}
	}
	if len(devs) == 0 {
		return errors.New("the guest's virtio balloon driver drives no device")
	}
	for _, d := range devs {
		if err := os.WriteFile(filepath.Join(dir, "unbind"), []byte(d), 0); err != nil {
			return fmt.Errorf("let balloon %s go: %w", d, err)
		}
		if err := os.WriteFile(filepath.Join(dir, "bind"), []byte(d), 0); err != nil {
			return fmt.Errorf("take balloon %s again: %w", d, err)
		}
	}
	return nil
}

// ReprobeBalloon asks the guest to have its balloon driver take its device
// again (LinuxSystem.ReprobeBalloon).
func (c *Client) ReprobeBalloon(ctx context.Context) error {
	return c.call(ctx, methodReprobeBalloon, nil, nil)
}
