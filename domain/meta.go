package domain

import (
	"encoding/xml"
	"fmt"
	"time"
)

// MetadataNS is the XML namespace of kvbox's facts about a box inside the
// domain's <metadata>. `virsh dumpxml` shows them; kvbox keeps no other
// database of boxes.
const MetadataNS = "https://kvbox.dev/xmlns/box/1"

// Meta is what kvbox records about a box in its domain XML.
type Meta struct {
	XMLName  xml.Name `xml:"https://kvbox.dev/xmlns/box/1 box" json:"-"`
	Image    string   `xml:"image,omitempty" json:"image,omitempty"`
	Snapshot string   `xml:"snapshot,omitempty" json:"snapshot,omitempty"`
	IP       string   `xml:"ip" json:"ip"`
	Prefix   int      `xml:"prefix" json:"prefix"`
	Gateway  string   `xml:"gateway" json:"gateway"`
	MAC      string   `xml:"mac" json:"mac"`
	Bridge   string   `xml:"bridge" json:"bridge"`
	// Group is the box group the box is in (kvbox new --network
	// group:NAME): Bridge is then the group's, where boxes reach each other.
	Group     string    `xml:"group,omitempty" json:"group,omitempty"`
	Dir       string    `xml:"dir" json:"dir"`
	DiskBytes int64     `xml:"disk-bytes" json:"disk_bytes"`
	Transport string    `xml:"transport" json:"transport"`
	Created   time.Time `xml:"created" json:"created"`
	// Expires is the box's deadline (kvbox new --ttl, kvbox ttl): its
	// reaper removes it then.
	Expires *time.Time `xml:"expires,omitempty" json:"expires,omitempty"`
	// Suspended is set while the box is suspended (kvbox suspend): its
	// memory and device state wait on disk for kvbox resume.
	Suspended *Suspended `xml:"suspended,omitempty" json:"suspended,omitempty"`
}

// Suspended is where a suspended box's saved state is.
type Suspended struct {
	At time.Time `xml:"at" json:"at"`
	// State is the migration stream's file in the box's folder: device
	// state, and with MappedRAM the RAM too (at Offset), which the resumed
	// box then maps privately. Without MappedRAM (a box an earlier kvbox
	// suspended) the RAM stays in the box's own memory file.
	State       string `xml:"state" json:"state"`
	MappedRAM   bool   `xml:"mapped-ram" json:"mapped_ram"`
	Offset      int64  `xml:"offset" json:"offset"`
	PauseMillis int64  `xml:"pause-ms" json:"pause_ms"`
}

// MarshalMeta renders m as the element kept under the domain's <metadata>.
func MarshalMeta(m Meta) (string, error) {
	m.XMLName = xml.Name{Space: MetadataNS, Local: "box"}
	b, err := xml.MarshalIndent(m, "    ", "  ")
	if err != nil {
		return "", fmt.Errorf("render kvbox metadata: %w", err)
	}
	return "    " + string(b), nil
}
