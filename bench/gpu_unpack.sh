#!/usr/bin/env bash
# Unpack what a gpu_session.sh call sent back: each gpu-session-p<N>.tar.gz (and a -jit archive, whole or in
# parts) under DEST, and the FlashInfer modules it compiled into .gpu-jit/, which the next call carries so
# they load as AOT modules instead of compiling again. Run here, from the repo root:
#
#     bash bench/gpu_unpack.sh FILES_AT [DEST]      # DEST: /tmp/gpu-results by default
set -euo pipefail
src=${1:?usage: gpu_unpack.sh FILES_AT [DEST]}
dest=${2:-/tmp/gpu-results}
mkdir -p "$dest"
shopt -s nullglob
for a in "$src"/gpu-session-p[0-9].tar.gz; do
    tar -xzf "$a" -C "$dest"
done
for first in "$src"/gpu-session-p[0-9]-jit.tar.gz "$src"/gpu-session-p[0-9]-jit.tar.gz.0; do
    cat "${first%.0}"* | tar -xzf - -C "$dest"
done
grep -qxF '/.gpu-jit/' .gitignore 2>/dev/null || git check-ignore -q .gpu-jit/probe \
    || echo '/.gpu-jit/' >> "$(git rev-parse --git-path info/exclude)"
for d in "$dest"/gpu-session-p*/jit; do
    mkdir -p .gpu-jit && cp -r "$d"/. .gpu-jit/
done
for s in "$dest"/gpu-session-p*/summary; do
    echo "== $s"
    cat "$s"
done
du -sh .gpu-jit 2>/dev/null || true
