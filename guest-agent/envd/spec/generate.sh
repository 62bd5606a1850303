#!/usr/bin/env bash
# Regenerates the Go code of the envd .proto files in this folder:
#
#   guest-agent/envd/spec/generate.sh [OUTDIR]
#
# (or go generate ./guest-agent/envd/spec). OUTDIR, default this folder, is
# where process/ and filesystem/ are written; TestGeneratedCode writes to a
# temporary one and compares.
#
# protoc is Debian's protobuf-compiler, and the well-known types the files
# import (google/protobuf/timestamp.proto) come with libprotobuf-dev
# (apt-get install protobuf-compiler libprotobuf-dev);
# the two plugins are built from the module versions go.mod pins
# (google.golang.org/protobuf for protoc-gen-go, connectrpc.com/connect for
# protoc-gen-connect-go), so the output depends on go.mod alone.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
command -v protoc >/dev/null || { echo "generate.sh: protoc not found: apt-get install protobuf-compiler" >&2; exit 1; }
[ -f /usr/include/google/protobuf/timestamp.proto ] ||
	{ echo "generate.sh: /usr/include/google/protobuf/timestamp.proto not found: apt-get install libprotobuf-dev" >&2; exit 1; }
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
cd "$here"
go build -o "$bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$bin/protoc-gen-connect-go" connectrpc.com/connect/cmd/protoc-gen-connect-go
mkdir -p "$out"
PATH=$bin:$PATH protoc -I "$here" -I /usr/include \
	--go_out="$out" --go_opt=paths=source_relative \
	--connect-go_out="$out" --connect-go_opt=paths=source_relative \
	process/process.proto filesystem/filesystem.proto
