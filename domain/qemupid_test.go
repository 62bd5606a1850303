package domain

import (
	"reflect"
	"testing"
)

func TestBlockdevArgs(t *testing.T) {
	// As libvirt 11 starts a box's QEMU, with an older key=value
	// -blockdev and a broken one among them.
	args := []string{"/usr/bin/qemu-system-x86_64", "-name", "guest=dev,debug-threads=on",
		"-blockdev", `{"driver":"file","filename":"/img/disk.qcow2","node-name":"libvirt-2-storage","auto-read-only":true,"discard":"unmap"}`,
		"-blockdev", `{"node-name":"libvirt-2-format","read-only":true,"driver":"qcow2","file":"libvirt-2-storage","backing":null}`,
		"-blockdev", "driver=file,filename=/old.img,node-name=old",
		"-blockdev", `{"node-name":`,
		"-device", `{"driver":"virtio-blk-pci","drive":"libvirt-2-format"}`,
		"-blockdev"}
	got := blockdevArgs(args)
	want := map[string]map[string]any{
		"libvirt-2-storage": {"driver": "file", "filename": "/img/disk.qcow2", "node-name": "libvirt-2-storage", "auto-read-only": true, "discard": "unmap"},
		"libvirt-2-format":  {"node-name": "libvirt-2-format", "read-only": true, "driver": "qcow2", "file": "libvirt-2-storage", "backing": nil},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("blockdevArgs:\n got %v\nwant %v", got, want)
	}
}
