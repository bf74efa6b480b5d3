"""scripts/README.md names every script in scripts/, and nothing that is not there."""
import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_the_index_names_every_script():
    text = (SCRIPTS / "README.md").read_text()
    named = set(re.findall(r"`((?:timeline/)?[\w.]+\.(?:py|sh|c))`", text))
    present = {path.relative_to(SCRIPTS).as_posix() for path in SCRIPTS.rglob("*")
               if path.suffix in (".py", ".sh", ".c") and "__pycache__" not in path.parts}
    assert named == present
