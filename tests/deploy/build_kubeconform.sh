#!/usr/bin/env bash
# Builds kubeconform (the Kubernetes manifest validator) from the Go module proxy into a cache
# folder, once, and prints the binary's path. Small: a few seconds and a few MB of modules.
set -euo pipefail

version=v0.8.0
cache="${XDG_CACHE_HOME:-$HOME/.cache}/specroute/kubeconform-${version}"
bin="$cache/kubeconform"

if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi
command -v go >/dev/null || { echo "build_kubeconform.sh: Go (>= 1.24) is needed to build kubeconform" >&2; exit 1; }

mkdir -p "$cache"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "build_kubeconform.sh: building kubeconform ${version}" >&2
GOBIN="$work" CGO_ENABLED=0 go install "github.com/yannh/kubeconform/cmd/kubeconform@${version}"
mv "$work/kubeconform" "$bin.partial"
mv "$bin.partial" "$bin"   # atomic: a half-written binary is never taken for a finished one
echo "$bin"
