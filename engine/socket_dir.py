"""The private directory that holds a server's front<->scheduler unix sockets.

Abstract unix sockets (Linux's `@name`) have no file and so no permissions: any process in
the pod's network namespace (a sidecar, a hostNetwork pod) could connect to a scheduler's
PULL socket and feed it requests, or to the front's and read every user's output. Sockets
under a 0700 directory are reachable by this user only.

A server killed with SIGKILL cannot remove its directory, so each name carries its owner's
pid and every start sweeps the directories of owners that are gone: at most one stale
directory per killed server lives until the next server starts.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "tandem-dp-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[a-z0-9_]+$")


def runtime_root() -> Path:
    """$XDG_RUNTIME_DIR (per user, 0700, a tmpfs) when set, else the temp directory."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) if xdg and Path(xdg).is_dir() else Path(tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep(root: Path | None = None) -> list[Path]:
    """Remove the socket directories, owned by this user, whose owner process has exited."""
    root = root or runtime_root()
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = _NAME.match(d.name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        try:
            st = d.lstat()
        except OSError:
            continue
        # Only our own real directories: a symlink or another user's directory is left alone.
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def make(root: Path | None = None) -> Path:
    """A fresh 0700 directory for this process's sockets (after sweeping stale ones)."""
    root = root or runtime_root()
    sweep(root)
    d = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
    os.chmod(d, 0o700)  # mkdtemp's mode already, stated here because the security rests on it
    return d
