// Package base is the ground every other kvbox package stands on and
// nothing more: the kinds of failure an error can be (beside its message,
// never glued into it), the rules for names and sizes, and file locks. It
// imports nothing of kvbox, so image, registry and the guest side can use
// it without the libvirt layer.
package base
