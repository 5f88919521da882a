#!/usr/bin/env bash
# The README's test command: installs what the tests drive (scripts/prepare.sh; HOLO_PREPARE=0 leaves it
# out), runs every test of the workspace (arguments go to `cargo test --workspace`), then lists the tests
# that skipped for a missing component. Under CI=true nothing skips: a missing component fails its test,
# and a component that cannot be installed fails this script before any test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
ci=false
case "${CI:-}" in true | 1) ci=true ;; esac
if [ "${HOLO_PREPARE:-1}" = 1 ]; then
    if ! bash scripts/prepare.sh all; then
        if [ "$ci" = true ]; then
            echo "error: scripts/prepare.sh could not install every component (above); CI=true runs no test without them" >&2
            exit 1
        fi
        echo "warning: scripts/prepare.sh could not install every component (above); the tests that need one will say SKIPPED" >&2
    fi
fi
skipped="${CARGO_TARGET_DIR:-target}/tmp/skipped-tests.txt"
rm -f "$skipped"
status=0
cargo test --workspace "$@" || status=$?
if [ -s "$skipped" ]; then
    echo >&2
    echo "$(wc -l < "$skipped") test(s) skipped for a missing component:" >&2
    sort "$skipped" >&2
else
    echo "no test skipped" >&2
fi
exit "$status"
