#!/usr/bin/env bash
# Stage the serving wheels the GPU machine lacks (fastapi, uvicorn, pydantic, xgrammar, jsonschema, ...) into
# the ignored .whl/, for a device call that carries `.whl` (docs/gpu.md). Run here, from the repo root, where
# the package index is reachable; the GPU machine has none:
#
#     bash bench/stage_wheels.sh
#
# The list, pinned, is bench/gpu_wheels.txt. Each is a cp312 manylinux x86-64 wheel (the machine's python3 is
# 3.12, its glibc takes any manylinux tag up to 2_39), fetched without its dependencies, as device/README.md's
# recipe does; bench/wheel_needs.py then checks that every Requires-Dist is met by a staged wheel or by the
# image (bench/gpu_image_packages.txt), so a missing one fails here, not in the middle of a GPU session.
# gpu_session.sh installs them with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
# .gitignore ignores /.whl/ already; a checkout without that line gets it in its local exclude file.
git check-ignore -q .whl/probe.whl || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
rm -rf .whl && mkdir .whl
platforms=()
for n in 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35 2_39; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl -r bench/gpu_wheels.txt 2>&1 | grep -v "^WARNING: Location" || true
want=$(grep -cvE '^[[:space:]]*(#|$)' bench/gpu_wheels.txt)
got=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$got" -ne "$want" ]; then
    echo "staged $got wheels of the $want in bench/gpu_wheels.txt" >&2
    exit 1
fi
python3 bench/wheel_needs.py .whl --present bench/gpu_image_packages.txt | tail -1
# What a device call carries must stay under 64 MiB: the tracked tree, .gpu (the kit), .whl and .gpu-jit.
du -sh .whl
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(du -cb .whl $(ls -d .gpu .gpu-jit 2>/dev/null) | tail -1 | cut -f1)
echo "travels: $(( (tracked + carried) / 1048576 )) MiB (tracked $(( tracked / 1048576 )) MiB + .whl/.gpu/.gpu-jit;" \
     "64 MiB at most)"
if [ $(( tracked + carried )) -gt $(( 62 * 1048576 )) ]; then
    echo "WARNING: within 2 MiB of the 64 MiB limit or over it" >&2
fi
