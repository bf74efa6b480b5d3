"""CURVE key pairs for tests, as `moerun keys` writes them."""
from __future__ import annotations

from pathlib import Path

from moerun.ipc.curve import write_key_pair


def rig_key_folder(folder: Path) -> Path:
    """The daemon's, its parent's, a stranger's and another daemon's pairs in `folder`;
    parents/ holds the one public key the daemon authorizes."""
    for name in ("daemon", "parent", "stranger", "other-daemon"):
        write_key_pair(folder, name)
    (folder / "parents").mkdir()
    (folder / "parents" / "parent.key").write_bytes((folder / "parent.key").read_bytes())
    return folder
