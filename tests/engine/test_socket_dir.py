"""The front<->scheduler sockets live in a private directory, and a killed server's is swept."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from tandem.engine import socket_dir


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_directory_is_private_and_named_for_its_owner(tmp_path: Path) -> None:
    d = socket_dir.make(tmp_path)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert d.name.startswith(f"{socket_dir.PREFIX}{os.getpid()}-")


def test_sweep_removes_only_our_dead_owners_directories(tmp_path: Path) -> None:
    dead = tmp_path / f"{socket_dir.PREFIX}{_dead_pid()}-abc123"
    dead.mkdir()
    (dead / "in0").write_text("")
    alive = tmp_path / f"{socket_dir.PREFIX}{os.getppid()}-abc123"
    alive.mkdir()
    other = tmp_path / "tandem-dp-not-a-pid"
    other.mkdir()
    target = tmp_path / "precious"
    target.mkdir()
    link = tmp_path / f"{socket_dir.PREFIX}{_dead_pid()}-link"
    link.symlink_to(target)  # a planted symlink is never followed into a removal
    mine = socket_dir.make(tmp_path)
    assert not dead.exists()
    assert alive.exists() and other.exists() and mine.exists() and target.exists() and link.is_symlink()


def test_a_killed_servers_directory_is_swept_at_the_next_start(tmp_path: Path) -> None:
    code = (f"from tandem.engine import socket_dir; from pathlib import Path; "
            f"print(socket_dir.make(Path({str(tmp_path)!r})), flush=True); import time; time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    left = Path(p.stdout.readline().strip())
    p.kill()
    p.wait()
    assert left.exists()  # SIGKILL: nothing ran to remove it
    socket_dir.make(tmp_path)
    assert not left.exists()
