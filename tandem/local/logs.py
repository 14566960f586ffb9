"""Each component's output: prefixed lines on the terminal, or one file per component.

Either way the last lines of every component are kept, so that when one dies the
supervisor can say why without sending the user to a file.
"""

from __future__ import annotations

import collections
import subprocess
import threading
from pathlib import Path
from typing import IO, TextIO

_COLORS = ("36", "35", "33", "32", "34", "31")
TAIL_LINES = 30


class LogSink:
    def __init__(self, out: TextIO, log_dir: Path | None = None, color: bool = False) -> None:
        self.out, self.log_dir, self.color = out, log_dir, color
        self.lock = threading.Lock()
        self.tails: dict[str, collections.deque[str]] = {}
        self.pumps: list[threading.Thread] = []
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def stdout_for(self, name: str) -> IO[bytes] | int:
        """What the child's stdout (and stderr) go to; a file is opened for appending, so a
        restarted component keeps its earlier lines."""
        path = self.path(name)
        return subprocess.PIPE if path is None else open(path, "ab")  # noqa: SIM115 (the child owns it)

    def attach(self, name: str, proc: subprocess.Popen) -> None:
        self.tails.setdefault(name, collections.deque(maxlen=TAIL_LINES))
        if proc.stdout is not None:
            width = max(10, len(name))
            tag = f"{name:<{width}} | "
            if self.color:
                tag = f"\033[{_COLORS[sum(map(ord, name)) % len(_COLORS)]}m{tag}\033[0m"
            t = threading.Thread(target=self._pump, args=(name, tag, proc.stdout), daemon=True,
                                 name=f"log-{name}")
            t.start()
            self.pumps.append(t)

    def _pump(self, name: str, tag: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tails[name].append(line)
            self.say(tag + line)
        stream.close()

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(text + "\n")
            self.out.flush()

    def tail(self, name: str) -> list[str]:
        path = self.path(name)
        if path is not None and path.exists():
            return path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        return list(self.tails.get(name, ()))

    def close(self, timeout: float = 5.0) -> None:
        for t in self.pumps:
            t.join(timeout)
