"""What `baton up` prints: children's lines under a `[name]` prefix, its own notes, the banner."""
from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

from services.launcher.process import ChildProcess, Stream


class Console:
    """Children's stdout lines go to stdout and their stderr lines to stderr, each prefixed
    `[prefill-0] ` (names padded to one width, as `docker compose up` does); `baton up`'s
    own notes go to stderr as `baton: ...`, the banner to stdout."""

    def __init__(self, names: Iterable[str], stdout: TextIO | None = None, stderr: TextIO | None = None):
        self.width = max((len(name) for name in names), default=0)
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr

    def forward(self, name: str, stream: Stream, line: str) -> None:
        out = self.stdout if stream == "stdout" else self.stderr
        out.write(f"[{name}]{' ' * (self.width - len(name))} {line}\n")
        out.flush()

    def note(self, message: str) -> None:
        self.stderr.write(f"baton: {message}\n")
        self.stderr.flush()

    def print(self, text: str) -> None:
        self.stdout.write(text + "\n")
        self.stdout.flush()


def process_table(children: Sequence[ChildProcess], addresses: dict[str, str]) -> str:
    """One row per child: name, pid, address(es), as aligned columns."""
    rows = [("PROCESS", "PID", "ADDRESS")]
    rows += [(child.name, str(child.pid), addresses.get(child.name, child.address or "")) for child in children]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"  {name:<{widths[0]}}  {pid:>{widths[1]}}  {address}".rstrip() for name, pid, address in rows)
