// Package suspend puts running boxes to sleep and wakes them.
//
// Suspend and Resume use the live-snapshot machinery (vmstate) on the box
// itself instead of libvirt's managed save: managed save writes every page of the
// guest's RAM into one stream and `virsh start` reads all of it back, both
// growing with the RAM (docs/design.md#suspend). kvbox copies the RAM live into
// a mapped-ram state file in the box's folder (QEMU stops the guest only
// for the last pass), and resume maps that file privately, as a clone maps
// its snapshot: a page is read from it when the guest first touches it, so
// neither the pause nor the resume grows with the RAM. The state file
// stays while the resumed box runs (its QEMU maps it, and a `virsh
// restore` of the box would map it again); the next suspend, or a cold
// start, deletes it.
//
// While suspended, the box's persistent definition's RAM backend is a file
// in a folder that does not exist (SUSPENDED-run-kvbox-resume-NAME): an
// operator's `virsh start` fails at once with that path in the error and
// changes nothing, instead of cold-booting over the saved memory or
// restoring a stale state later. kvbox ls shows the box as suspended.
package suspend
