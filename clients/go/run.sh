#!/usr/bin/env bash
# Generates the Go code of proto/envserve/v1/envserve.proto, then tests the Go client against a
# running replica: ENVSERVE_ADDRESS (host:port), ENVSERVE_TOKEN where the replica checks tokens.
#
#   clients/go/run.sh          generate, vet, `go test` and run the example program
#   clients/go/run.sh check    print what of the toolchain is missing (exit 2 when something is)
#
# It builds in GOPATH mode against the Go sources Debian's packages install under /usr/share/gocode
# (golang-google-grpc-dev, golang-google-protobuf-dev, golang-github-golang-protobuf-1-5-dev), so it
# needs no module proxy. The generated code and Go's build cache stay under build/clients/go
# (ENVSERVE_GO_BUILD_DIR), so a rerun only compiles what changed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${ENVSERVE_GO_BUILD_DIR:-$root/build/clients/go}"
deps=/usr/share/gocode

missing=()
for tool in go protoc protoc-gen-go protoc-gen-go-grpc; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
for pkg in google.golang.org/grpc google.golang.org/protobuf github.com/golang/protobuf; do
  [ -d "$deps/src/$pkg" ] || missing+=("$deps/src/$pkg")
done
# grpc-go marshals through github.com/golang/protobuf; its 1.3 series (which Debian installs by
# default beside grpc) predates the messages protoc-gen-go writes and panics on them: 1.4 and later
# delegate to google.golang.org/protobuf.
if [ -d "$deps/src/github.com/golang/protobuf/proto" ] &&
   ! grep -qs google.golang.org/protobuf "$deps"/src/github.com/golang/protobuf/proto/*.go; then
  missing+=("github.com/golang/protobuf 1.4 or later (golang-github-golang-protobuf-1-5-dev)")
fi
if [ "${1:-}" = check ]; then
  if [ ${#missing[@]} -gt 0 ]; then
    echo "missing: ${missing[*]} (Debian: apt-get install golang-go protobuf-compiler protoc-gen-go" \
         "protoc-gen-go-grpc golang-google-grpc-dev golang-google-protobuf-dev" \
         "golang-github-golang-protobuf-1-5-dev)"
    exit 2
  fi
  exit 0
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing: ${missing[*]}" >&2
  exit 2
fi
: "${ENVSERVE_ADDRESS:?set ENVSERVE_ADDRESS to the host:port of a replica}"

# Generated afresh every run (protoc takes a fraction of a second), so the code never lags the proto;
# Go's cache keys on file contents, so unchanged output is not recompiled.
gen="$build/gopath/src"
mkdir -p "$gen" "$build/cache"
rm -rf "$gen/envserve.dev"
protoc -I"$root/proto" --go_out="$gen" --go-grpc_out="$gen" "$root/proto/envserve/v1/envserve.proto"

export GO111MODULE=off GOPATH="$build/gopath:$deps" GOCACHE="$build/cache" GOFLAGS=
cd "$here"
unformatted=$(gofmt -l .)
if [ -n "$unformatted" ]; then
  echo "not gofmt-formatted: $unformatted" >&2
  exit 1
fi
go vet . ./example
go test -count=1 -v .
go run ./example
