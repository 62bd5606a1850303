package egress

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
)

// The proxy and resolver learn a box's policy from a file of the state
// dir, one per box, named after the box's address (the source address
// of its connections, which kvbox's port filter pins to the box's tap):
// STATE/egress/boxes/ADDR.json, root's only, rewritten atomically by
// kvbox from the box's definition whenever its port is (re)filtered or
// its policy changes, and removed with the box. The proxy reads it at
// every new connection and query, so a changed policy holds from the
// next one, and a restarted proxy has lost nothing.

// Dir is where kvbox keeps what its egress proxy needs in state dir root.
func Dir(root string) string { return filepath.Join(root, "egress") }

func boxesDir(root string) string { return filepath.Join(Dir(root), "boxes") }

// BoxFile is the policy file of the box at addr.
func BoxFile(root string, addr netip.Addr) string {
	return filepath.Join(boxesDir(root), addr.String()+".json")
}

// Box is what the proxy knows of a box: who it is and its policy.
type Box struct {
	Name   string     `json:"name"`
	UUID   string     `json:"uuid,omitempty"`
	Addr   netip.Addr `json:"addr"`
	Policy Policy     `json:"policy"`
}

// WriteBox writes b's file (atomically: the proxy reads the old one or
// the new one).
func WriteBox(root string, b Box) error {
	if err := os.MkdirAll(boxesDir(root), 0o700); err != nil {
		return fmt.Errorf("egress policy of box %q: %w", b.Name, err)
	}
	data, err := json.Marshal(b)
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(boxesDir(root), ".tmp-*")
	if err != nil {
		return fmt.Errorf("egress policy of box %q: %w", b.Name, err)
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), BoxFile(root, b.Addr))
	}
	if err != nil {
		return fmt.Errorf("egress policy of box %q: %w", b.Name, err)
	}
	return nil
}

// RemoveBox removes the file of the box at addr if it is box name's (a
// file another box wrote since is that box's).
func RemoveBox(root string, addr netip.Addr, name string) error {
	b, err := ReadBox(root, addr)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err == nil && name != "" && b.Name != name {
		return nil
	}
	if err := os.Remove(BoxFile(root, addr)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// ReadBox reads the file of the box at addr; its policy is checked.
func ReadBox(root string, addr netip.Addr) (Box, error) {
	data, err := os.ReadFile(BoxFile(root, addr))
	if err != nil {
		return Box{}, err
	}
	var b Box
	if err := json.Unmarshal(data, &b); err != nil {
		return Box{}, fmt.Errorf("%s: %w", BoxFile(root, addr), err)
	}
	if b.Addr != addr {
		return Box{}, fmt.Errorf("%s is for %s", BoxFile(root, addr), b.Addr)
	}
	if err := b.Policy.Validate(); err != nil {
		return Box{}, fmt.Errorf("%s: %w", BoxFile(root, addr), err)
	}
	return b, nil
}

// Boxes lists the boxes with a policy file.
func Boxes(root string) ([]Box, error) {
	ents, err := os.ReadDir(boxesDir(root))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []Box
	for _, e := range ents {
		a, err := netip.ParseAddr(strings.TrimSuffix(e.Name(), ".json"))
		if err != nil || !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		if b, err := ReadBox(root, a); err == nil {
			out = append(out, b)
		}
	}
	return out, nil
}
