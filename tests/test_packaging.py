"""The one-package layout: every folder with an __init__.py is installed under `tandem`,
and the torch-free components import without torch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found <= listed, f"add to pyproject packages: {sorted(found - listed)}"


def test_operator_protocol_and_cli_never_import_torch() -> None:
    code = (
        "import sys; import tandem.cli, tandem.operator.reconcile, tandem.metric_names, tandem.worker_contract;"
        "import tandem.protocol.messages, tandem.protocol.openai_api, tandem.protocol.kv_layout;"
        "tandem.cli.build_parser();"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
