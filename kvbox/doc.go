// Package kvbox is kvbox: boxes, snapshots, warm clones and everything
// they imply, callable from Go with a context and typed results. The CLI
// (cmd/kvbox), kvbox serve and kvbox-node are fronts of it: they parse,
// call this package and print, so that each does exactly what the others
// do (kvbox rm unpublishes, removes the domain and the folder, reaps an
// expired snapshot the box was the last clone of and prunes an image
// version, whoever asks).
//
// Open a Host on a state directory; a Host is safe for concurrent use by
// many goroutines, and two Hosts on one libvirt with different state
// directories never see or touch each other's boxes, snapshots, group
// networks or port-filter entries. Errors carry a kind (KindOf) beside
// their message.
//
// What is here so far: Open (recovery and the TTL sweep, told to
// Config.Notify), Create, Clone, CreateMany and CloneMany (a box with its
// deadline, labels, hostname and published ports, or nothing), Snapshot,
// Snapshots and GetSnapshot, Pull and Resolve, Remove, RemoveMany and
// RemoveSnapshot with everything they imply, Start and Stop with the box's
// published ports, Suspend and Resume, Exec (WhyExec says why a command
// did not run to its end), Dial, Connect, ServePorts and Ping (into a box
// through its agent, one shared connection per box),
// ConsoleLog and Stats, the host's HostCompat, Capacity and Healthy, the
// TTL (SetExpires, Sweep, RunReaper; a deadline removes its box or, when
// asked, suspends it), CopyIn and CopyOut (files into and out of a box),
// Push and Inspect (a snapshot to a registry, its lineage), RemoveImage and
// PruneImage, NetworkUp and RemoveNetwork. Long operations report to a
// progress.Reporter (nil: nobody). The CLI, kvbox serve (package
// kvbox/e2b) and kvbox-node (integrations/kubernetes/libadapter) call it
// for what they do beyond parsing and printing; the CLI's images ls,
// import and build use package image's store, which needs no Host.
package kvbox
