// Package spec holds the wire contract of envd, E2B's in-sandbox daemon: the
// .proto files of its process and filesystem services, written for kvbox,
// and the Go code generated from them (process/, filesystem/ and their
// connect subpackages), committed so that a build needs no protoc.
// generate.sh makes that code again; TestGeneratedCode checks it is current.
package spec

//go:generate ./generate.sh
