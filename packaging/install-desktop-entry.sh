#!/usr/bin/env bash
# Install the desktop entry and icon for the current user, so the app appears in the desktop's application menu.
#   packaging/install-desktop-entry.sh [COMMAND]
# COMMAND is what the entry runs: by default the `inference-lab` found on PATH (pipx or uv tool put it in
# ~/.local/bin); give the bundle's executable to launch the bundle. The entry names it by absolute path, because a
# desktop session's PATH often lacks ~/.local/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-$(command -v inference-lab || true)}
if [ -z "$cmd" ] || [ ! -x "$cmd" ]; then
    echo "install-desktop-entry: no inference-lab command to launch: install the app (packaging/README.md) or name" \
         "its executable as the argument" >&2
    exit 1
fi
cmd=$(realpath -s "$cmd")
case $cmd in
    *[\"\`\$\\%]*) echo "install-desktop-entry: $cmd: a path with \", \`, \$, \\ or % cannot be named in a desktop" \
                     "entry here; install the app under another folder" >&2; exit 1 ;;
    *[!A-Za-z0-9/._+-]*) exec_line="Exec=\"$cmd\"" ;;  # spaces and the like: the desktop entry spec's quoting
    *) exec_line="Exec=$cmd" ;;
esac
apps=${XDG_DATA_HOME:-$HOME/.local/share}/applications
icons=${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor/scalable/apps
mkdir -p "$apps" "$icons"
EXEC_LINE=$exec_line awk '/^Exec=/ { print ENVIRON["EXEC_LINE"]; next } 1' resources/inference-lab.desktop \
    > "$apps/inference-lab.desktop"
chmod 644 "$apps/inference-lab.desktop"
install -m 644 resources/inference-lab.svg "$icons/"
echo "installed $apps/inference-lab.desktop ($exec_line)"
