"""A byte-count progress bar on stderr for weight uploads."""
from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)


class UploadProgress:
    def __init__(self, total_bytes: int, device: str):
        self._bar = Progress(TextColumn(f"loading weights to {device}"), BarColumn(), DownloadColumn(),
                             TransferSpeedColumn(), console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task("upload", total=total_bytes)
        self._bar.start()

    def advance(self, nbytes: int) -> None:
        self._bar.advance(self._task, nbytes)

    def close(self) -> None:
        self._bar.stop()
