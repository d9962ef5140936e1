#!/usr/bin/env bash
# Installs the openai Node SDK pinned in tests/proxy/node_sdk/package-lock.json into
# tests/proxy/node_sdk/node_modules with `npm ci`, once per lock file (a stamp holds the lock's
# hash). Used by `make node-sdk` (a prerequisite of `make test`) and by tests/proxy/test_node_sdk.py.
set -euo pipefail

dir="$(cd "$(dirname "$0")/../proxy/node_sdk" && pwd)"
stamp="$dir/node_modules/.specroute-lock-sha256"

# Without node or npm there is nothing to install: tests/proxy/test_node_sdk.py skips, saying why.
command -v node >/dev/null || { echo "install_node_sdk.sh: no node (>= 20): the Node SDK tests will skip" >&2; exit 0; }
command -v npm >/dev/null || { echo "install_node_sdk.sh: no npm: the Node SDK tests will skip" >&2; exit 0; }

want=$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$dir/node_modules/openai/package.json" ]; then
    exit 0
fi
echo "install_node_sdk.sh: npm ci in $dir" >&2
(cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
echo "$want" > "$stamp"
