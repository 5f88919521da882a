#!/bin/sh
# Installs Debian's headless-capable Chromium, the browser `holo-runtime/tests/cli/view_cli.rs` renders
# `holo view`'s page in (without it that test skips, saying so). Run as root, or with sudo:
#
#     sh scripts/install_chromium.sh
set -eu
if command -v chromium >/dev/null 2>&1; then
    chromium --version
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
$SUDO apt-get update
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
chromium --version
