#!/usr/bin/env bash
# Unpack what a gpu_session.sh call sent back: each gpu-session-p<N>.tar.gz (and a -jit archive, whole or in
# parts) under DEST, and the FlashInfer modules it compiled, added to .gpu-jit/modules.tar.xz, which the next
# call carries so they load as AOT modules instead of compiling again. Run here, from the repo root:
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
# Kept xz-compressed (about a third of their size): the tree a call carries may not pass 64 MiB, and the kit
# alone is 38. gpu_session.sh unpacks .gpu-jit/*.tar.xz into FlashInfer's AOT folder.
jit=$(mktemp -d)
[ -f .gpu-jit/modules.tar.xz ] && tar -xJf .gpu-jit/modules.tar.xz -C "$jit"
for d in "$dest"/gpu-session-p*/jit; do
    cp -r "$d"/. "$jit"/
done
if [ -n "$(ls -A "$jit")" ]; then
    mkdir -p .gpu-jit && tar -cJf .gpu-jit/modules.tar.xz.part -C "$jit" . && mv .gpu-jit/modules.tar.xz.part .gpu-jit/modules.tar.xz
    echo "FlashInfer modules in .gpu-jit/modules.tar.xz: $(ls "$jit" | tr '\n' ' ')"
fi
rm -rf "$jit"
for s in "$dest"/gpu-session-p*/summary; do
    echo "== $s"
    cat "$s"
done
du -sh .gpu-jit 2>/dev/null || true
