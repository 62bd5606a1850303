// Package agent owns the kvbox guest agent: the frame protocol both sides
// speak, the guest-side server that runs inside a box (cmd/kvbox-agent), and
// the host-side Client that kvbox commands use to reach it.
//
// The agent never listens on the network. It is reached over virtio-serial
// ports named org.kvbox.agent.K (one host connection per port at a time,
// hence several ports) or over vsock port 1024 where the host has
// vhost-vsock.
//
// A virtio-serial port outlives host connections: a host that disconnects
// and the next one that connects share one byte stream in each direction, so
// stale bytes can remain. Every frame therefore starts with a magic and
// carries CRCs, the decoder resynchronises on the magic after garbage, and a
// host opens every connection with a HELLO carrying a random nonce and
// discards everything until the matching HELLO reply. On HELLO the guest
// aborts whatever that port was doing.
package agent
