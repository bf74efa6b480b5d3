"""The source passes ruff with the project's settings (pyproject.toml [tool.ruff]): pycodestyle,
pyflakes, import order, no blind `except Exception` without its reason. ruff is a test
dependency (`pip install -e ".[test]"`, what scripts/test.sh installs)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "moerun", "ipc", "daemons", "tests",
                             "scripts"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
