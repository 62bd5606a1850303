// Package vmstate is kvbox's QEMU state engine: the memory and device
// state of a running box saved into a file, and a box started from one.
//
// A restore starts QEMU from a domain XML that maps the state file, saved
// in QEMU's mapped-ram layout, privately (RestoreXML, PrepareMapped) and
// loads the device state into it (Load). The disk of a box keeps its page
// cache through saves and restores (KeepPageCache).
package vmstate
