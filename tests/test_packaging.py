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
        "import tandem.pd, tandem.pd.protocol, tandem.pd.secret, tandem.web.errors, tandem.web.json_body;"
        "import tandem.router.app, tandem.router.cli;"
        "tandem.cli.build_parser();"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_both_roles_implement_the_role_part_seam() -> None:
    """The engine is built on by the PD roles, never the reverse (test_import_graph.py): the
    caller passes a role's attach (engine/scheduler/role_part.py); both parts have every hook."""
    import inspect

    from tandem.decode.receiver import DecodeReceiver
    from tandem.engine.scheduler.role_part import RolePart
    from tandem.prefill.sender import PrefillSender

    hooks = [name for name, _ in inspect.getmembers(RolePart, inspect.isfunction) if not name.startswith("_")]
    assert {"admit", "abort", "poll", "on_batch_done", "on_retire", "busy", "check_integrity", "status"} <= set(hooks)
    for part in (PrefillSender, DecodeReceiver):
        assert all(callable(getattr(part, name, None)) for name in hooks), part
        assert part.contiguous_pages is True
        assert part.tick_codec is not None  # TP rank 0 passes the part's inbox messages on in its tick
