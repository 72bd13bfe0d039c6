#!/usr/bin/env bash
# The wheel folder of the GPU check (docs/gpu.md): the GPU machine has no package registry,
# so what dev/gpu_check.sh installs there is fetched here beforehand and travels with the
# working tree (the device tool's `carry`).
#
#     bash dev/gpu_wheels.sh fetch   # fill dev/gpu_wheels/ (needs the package registry)
#     bash dev/gpu_wheels.sh check   # pip's resolver, dry run, for CPython 3.12 on
#                                    # manylinux x86-64: the folder + the image's packages
#
# fetch: the exact wheels of dev/gpu_wheels.txt for the image's Python 3.12, without their
# requirements (the image has them: dev/gpu_image.txt); the folder is emptied first, since
# two versions of one package would stop the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DIR=dev/gpu_wheels
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")

case "${1:-}" in
    fetch)
        mkdir -p "$DIR"
        rm -f "$DIR"/*.whl
        "$PYTHON" -m pip download --no-deps "${TARGET[@]}" -d "$DIR" -r dev/gpu_wheels.txt
        du -sh "$DIR"
        ;;
    check)
        tmp="$(mktemp -d)"
        trap 'rm -rf "$tmp"' EXIT
        # The image's packages as metadata-only wheels, so that the resolver can see them.
        "$PYTHON" - dev/gpu_image.txt "$tmp/image" <<'PY'
import sys, zipfile
from pathlib import Path
out = Path(sys.argv[2]); out.mkdir()
for line in Path(sys.argv[1]).read_text().splitlines():
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    version = version or "9999"  # listed without a version: any version
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(out / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
PY
        # Only the two folders: no configured index, find-links or constraints of this machine.
        PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip --isolated install --dry-run --ignore-installed --no-index --find-links "$DIR" \
            --find-links "$tmp/image" "${TARGET[@]}" --target "$tmp/x" -r dev/gpu_wheels.txt
        echo "folder: $(du -sh "$DIR" | cut -f1), $(ls "$DIR"/*.whl | wc -l) wheel(s)"
        ;;
    *)
        echo "usage: bash dev/gpu_wheels.sh fetch|check" >&2
        exit 2
        ;;
esac
