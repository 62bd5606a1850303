// Package e2b is kvbox serve on the kvbox library: E2B's API (package
// serve) over a kvbox Host (Host), its API key in the state dir (Key) and
// its one listener (Run). The CLI's `kvbox serve` parses its flags, calls
// Run and prints what Run says it listens on.
package e2b
