#!/usr/bin/env bash
# Smoke test of an installed Inference Lab: start it headless, generate 4 tokens from "Hello", save a screenshot, and
# check the picture is a whole window (dimensions, size) rather than an empty or failed one.
#   packaging/smoke.sh NAME COMMAND OUT_DIR      e.g. packaging/smoke.sh pipx build/package/pipx/bin/inference-lab out
# It runs from an empty folder with a fresh settings file and cache and without PYTHONPATH, so nothing from this
# checkout or this user's ~/.cache can stand in for what the installed app lacks. Prints the seconds it took.
set -euo pipefail
name=$1 cmd=$(realpath "$2") out=$(realpath -m "$3")
mkdir -p "$out"
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
png=$out/$name.png
rm -f "$png"
start=$(date +%s.%N)
(cd "$home" && env -u PYTHONPATH QT_QPA_PLATFORM=offscreen INFERENCE_LAB_SETTINGS="$home/settings.ini" \
    INFERENCE_LAB_CACHE="$home/cache" "$cmd" --prompt "Hello" --max-new-tokens 4 --greedy --timeout 300 \
    --screenshot "$png")
end=$(date +%s.%N)
# A PNG's IHDR holds width and height; a whole window at the headless size is about 1600x1000 and, with every
# panel painted, some hundreds of kB (an empty dark window compresses to a few kB).
python3 - "$png" "$name" "$start" "$end" <<'EOF'
import struct
import sys

path, name, start, end = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
data = open(path, "rb").read()
if data[:8] != b"\x89PNG\r\n\x1a\n":
    sys.exit(f"smoke {name}: {path} is not a PNG")
width, height = struct.unpack(">II", data[16:24])
if width < 1200 or height < 800:
    sys.exit(f"smoke {name}: {path} is {width}x{height}, not a whole window")
if len(data) < 100_000:
    sys.exit(f"smoke {name}: {path} is only {len(data)} bytes: the panels did not paint")
print(f"smoke {name}: ok, {width}x{height} PNG of {len(data) // 1024} kB, {end - start:.1f} s to the screenshot")
EOF
