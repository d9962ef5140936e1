#!/usr/bin/env bash
# Builds Jaeger v2 (tagged v1.76.0 == v2.13.0) from source into a cache folder, once.
# `go install ...@v1.76.0` refuses the module ("go.mod contains replace directives"), so the
# module is fetched through the Go module proxy and built inside a writable copy of it.
# Prints the binary's path. Reuses the binary when it is already there.
set -euo pipefail

version=v1.76.0
cache="${XDG_CACHE_HOME:-$HOME/.cache}/specroute/jaeger-${version}"
bin="$cache/jaeger"

if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi
command -v go >/dev/null || { echo "build_jaeger.sh: Go (>= 1.24) is needed to build Jaeger" >&2; exit 1; }

mkdir -p "$cache"
src=$(go mod download -json "github.com/jaegertracing/jaeger@${version}" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -n "$src" ] || { echo "build_jaeger.sh: go mod download gave no source folder" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$src/." "$work/"
chmod -R u+w "$work"
echo "build_jaeger.sh: building Jaeger ${version} (takes a few minutes the first time)" >&2
(cd "$work" && CGO_ENABLED=0 go build -o "$bin.partial" ./cmd/jaeger)
mv "$bin.partial" "$bin"   # atomic: a half-written binary is never taken for a finished one
echo "$bin"
