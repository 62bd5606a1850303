package domain

import (
	"context"
	"encoding/xml"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/statedir"
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
	// OnExpiry is what the box's deadline does: "" removes the box,
	// ExpirySuspend suspends it (and takes the deadline away).
	OnExpiry string `xml:"on-expiry,omitempty" json:"on_expiry,omitempty"`
	// NoInternet: the box has no route out of the host (its port filter
	// drops what it sends the host to route); boxes of its group still
	// reach it.
	NoInternet bool `xml:"no-internet,omitempty" json:"no_internet,omitempty"`
	// Egress is the box's egress policy (kvbox new --egress/--allow/--deny,
	// kvbox egress set): nil or empty allows what the network does. It is
	// part of the box: kept across stops, suspends and host restarts, given
	// to its snapshots' clones. Rules only, never a secret.
	Egress *egress.Policy `xml:"egress,omitempty" json:"egress,omitempty"`
	// Labels are facts a front keeps with the box (kvbox serve: the
	// sandbox's template and metadata). They are in the domain XML, which
	// libvirt shows to whoever may read domains (on many hosts every local
	// user, read-only): never a secret.
	Labels []Label `xml:"labels>label,omitempty" json:"labels,omitempty"`
	// Hostname is the guest's hostname when it is not the box's name (a
	// pod's name, while its box is named to be unique on the host).
	Hostname string `xml:"hostname,omitempty" json:"hostname,omitempty"`
}

// ExpirySuspend is Meta.OnExpiry of a box its deadline suspends.
const ExpirySuspend = "suspend"

// Label is one key and value of Meta.Labels.
type Label struct {
	Key   string `xml:"key,attr" json:"key"`
	Value string `xml:",chardata" json:"value"`
}

// LabelMap is labels as a map.
func LabelMap(labels []Label) map[string]string {
	if len(labels) == 0 {
		return nil
	}
	m := make(map[string]string, len(labels))
	for _, l := range labels {
		m[l.Key] = l.Value
	}
	return m
}

// Labels is m as labels, sorted by key.
func Labels(m map[string]string) []Label {
	if len(m) == 0 {
		return nil
	}
	out := make([]Label, 0, len(m))
	for k, v := range m {
		out = append(out, Label{Key: k, Value: v})
	}
	slices.SortFunc(out, func(a, b Label) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// ValidLabel says in one line what makes a label unfit for the domain's
// XML: an empty key, or text XML cannot carry (control characters, invalid
// UTF-8), which would not read back as it was written.
func ValidLabel(key, value string) error {
	if key == "" {
		return base.Errorf(base.Invalid, "a label needs a key")
	}
	for i, s := range []string{key, value} {
		if !utf8.ValidString(s) {
			return base.Errorf(base.Invalid, "label %q: not UTF-8", key)
		}
		for _, r := range s {
			// A value may span lines; a key (an XML attribute) may not.
			if r < 0x20 && (i == 0 || r != '\t' && r != '\n') || r == 0x7f || r == 0xFFFE || r == 0xFFFF {
				return base.Errorf(base.Invalid, "label %q: holds control characters", key)
			}
		}
	}
	return nil
}

// Suspended is where a suspended box's saved state is.
type Suspended struct {
	At time.Time `xml:"at" json:"at"`
	// State is the migration stream's file in the box's folder, written
	// with mapped-ram: device state and the RAM (at Offset), which the
	// resumed box then maps privately.
	State       string `xml:"state" json:"state"`
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

// SetExpires writes the box's deadline (nil: none) into its libvirt
// metadata, live and persistent (`virsh dumpxml` shows <expires>), and
// then, still under the box's lock, calls then (nil: nothing) with the box
// as it is now: the TTL's reaper is started there (package kvbox).
func (h *Host) SetExpires(ctx context.Context, name string, at *time.Time, then func(Box) error) (Box, error) {
	b, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return Box{}, err
	}
	defer release()
	if at != nil {
		t := at.UTC().Truncate(time.Second)
		at = &t
	}
	b.Expires = at
	if err := writeMeta(dom, b.Meta); err != nil {
		return Box{}, fmt.Errorf("set the deadline of box %q: %w", name, err)
	}
	if then != nil {
		if err := then(b); err != nil {
			return Box{}, err
		}
	}
	return b, nil
}

// SetLabels replaces the box's labels (Meta.Labels) in its libvirt
// metadata, live and persistent, and returns the box as it is now.
func (h *Host) SetLabels(ctx context.Context, name string, labels []Label) (Box, error) {
	for _, l := range labels {
		if err := ValidLabel(l.Key, l.Value); err != nil {
			return Box{}, err
		}
	}
	b, dom, release, err := h.LockedLookup(ctx, name)
	if err != nil {
		return Box{}, err
	}
	defer release()
	b.Labels = labels
	if err := writeMeta(dom, b.Meta); err != nil {
		return Box{}, fmt.Errorf("set the labels of box %q: %w", name, err)
	}
	return b, nil
}

// writeMeta replaces a domain's kvbox metadata, in its live definition when
// it runs and in its persistent one.
func writeMeta(dom *libvirt.Domain, m Meta) error { return WriteMeta(dom, m, true) }

// WriteMeta replaces a domain's kvbox metadata in its persistent
// definition, and with live also in the running one.
func WriteMeta(dom *libvirt.Domain, m Meta, live bool) error {
	md, err := MarshalMeta(m)
	if err != nil {
		return err
	}
	flags := libvirt.DOMAIN_AFFECT_CONFIG
	if active, err := dom.IsActive(); err == nil && active && live {
		flags |= libvirt.DOMAIN_AFFECT_LIVE
	}
	if err := dom.SetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, strings.TrimSpace(md), "kvbox", MetadataNS, flags); err != nil {
		return fmt.Errorf("%s", LibvirtMessage(err))
	}
	return nil
}

// The files kvbox keeps for a suspended box (statedir.SuspendLive, ...).
const (
	SuspendLive   = statedir.SuspendLive
	SuspendBoot   = statedir.SuspendBoot
	SuspendSaving = statedir.SuspendSaving
)

// SuspendFile is the file of kind kvbox keeps for the suspended box name.
func (h *Host) SuspendFile(name, kind string) string {
	return h.Layout().SuspendFile(name, kind)
}

// RemoveSuspendFiles deletes what kvbox keeps for a suspended box.
func (h *Host) RemoveSuspendFiles(name string) {
	for _, k := range []string{SuspendLive, SuspendBoot, SuspendSaving} {
		os.Remove(h.SuspendFile(name, k))
	}
}

// PullPlug ends a box's QEMU at once (SIGKILL, then libvirt's destroy): for
// a box whose state is saved or that is being removed.
func PullPlug(dom *libvirt.Domain, name string) error {
	killQEMU(name)
	return powerOff(dom, name)
}

// SuspendedBoxes are the names of boxes with suspend files (suspended, or
// being suspended or resumed).
func (h *Host) SuspendedBoxes() []string {
	m, _ := filepath.Glob(h.Layout().SuspendFiles())
	var out []string
	for _, p := range m {
		out = append(out, strings.TrimSuffix(filepath.Base(p), "."+SuspendBoot))
	}
	return out
}
