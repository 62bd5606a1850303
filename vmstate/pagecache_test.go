package vmstate

import (
	"reflect"
	"testing"

	"kvbox.dev/kvbox/qmp"
)

func TestReopenOptions(t *testing.T) {
	opened := map[string]map[string]any{
		"libvirt-1-storage": {"driver": "file", "filename": "/box/disk.qcow2", "node-name": "libvirt-1-storage", "auto-read-only": true, "discard": "unmap"},
		"libvirt-1-format":  {"driver": "qcow2", "node-name": "libvirt-1-format", "file": "libvirt-1-storage"},
		// An operator's blockcopy reused the name for another file.
		"libvirt-2-storage": {"driver": "file", "filename": "/img/old.qcow2", "node-name": "libvirt-2-storage"},
	}
	nodes := []qmp.BlockNode{
		{NodeName: "libvirt-1-format", Drv: "qcow2", File: "/box/disk.qcow2"},
		{NodeName: "libvirt-1-storage", Drv: "file", File: "/box/disk.qcow2"},
		{NodeName: "libvirt-2-storage", Drv: "file", File: "/img/new.qcow2"},
		{NodeName: "kvbox-snap-target-file", Drv: "file", File: "/snap/disk.qcow2"},
	}
	got := reopenOptions(opened, nodes)
	want := []map[string]any{{"driver": "file", "filename": "/box/disk.qcow2", "node-name": "libvirt-1-storage", "auto-read-only": true, "discard": "unmap", "drop-cache": false}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("reopenOptions:\n got %v\nwant %v", got, want)
	}
	if _, ok := opened["libvirt-1-storage"]["drop-cache"]; ok {
		t.Errorf("reopenOptions changed the options it was given")
	}
}

func TestOpenedNodes(t *testing.T) {
	opened := map[string]map[string]any{
		"libvirt-2-storage": {"driver": "file", "filename": "/img/disk.qcow2", "node-name": "libvirt-2-storage"},
		"libvirt-2-format":  {"driver": "qcow2", "node-name": "libvirt-2-format", "file": "libvirt-2-storage"},
		"libvirt-1-storage": {"driver": "file", "filename": "/box/disk.qcow2", "node-name": "libvirt-1-storage"},
	}
	got := reopenOptions(opened, openedNodes(opened))
	want := []map[string]any{
		{"driver": "file", "filename": "/box/disk.qcow2", "node-name": "libvirt-1-storage", "drop-cache": false},
		{"driver": "file", "filename": "/img/disk.qcow2", "node-name": "libvirt-2-storage", "drop-cache": false},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("reopenOptions(openedNodes):\n got %v\nwant %v", got, want)
	}
}
