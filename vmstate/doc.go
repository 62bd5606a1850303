// Package vmstate is kvbox's QEMU state engine: the memory and device
// state of a running box saved into a file, and a box started from one.
//
// A save (Save) copies the box's RAM live into a state file in QEMU's
// mapped-ram layout, paced so that QEMU stops the guest only for the last
// pass and its device state, and is undone once, from what it recorded
// before it changed anything (Record): the same undo that recovery runs
// for a kvbox that was killed half-way (Recover). A restore starts QEMU
// from a domain XML that maps the state file privately (RestoreXML,
// PrepareMapped) and loads the device state into it (Load). The disk of a
// box keeps its page cache through both (KeepPageCache).
//
// What a save is for is the caller's: snapshot takes the disk's point in
// time in the pause a save ends with and lets the box run on; suspend ends
// the box's QEMU.
package vmstate
