#!/usr/bin/env bash
# Install the desktop entry and icon for the current user.
set -euo pipefail
cd "$(dirname "$0")/.."
apps=${XDG_DATA_HOME:-$HOME/.local/share}/applications
icons=${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor/scalable/apps
mkdir -p "$apps" "$icons"
install -m 644 resources/inference-lab.desktop "$apps/"
install -m 644 resources/inference-lab.svg "$icons/"
echo "installed $apps/inference-lab.desktop"
