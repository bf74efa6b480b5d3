"""The GPU kernels' source as CuPy is given it: a change in any file of the kernel tree, headers
included, changes the code CuPy keys its cache of compiled modules by."""
from __future__ import annotations

import shutil

from moerun.backends.gpu.library import KERNEL_DIR, kernel_source


def test_a_changed_header_changes_the_source(tmp_path):
    tree = tmp_path / "kernels"
    shutil.copytree(KERNEL_DIR, tree)
    before = kernel_source(tree)
    assert before.endswith((KERNEL_DIR / "moerun.cu").read_text())
    assert kernel_source(tree) == before                                      # stable
    header = tree / "staging.cuh"
    header.write_text(header.read_text() + "\n// one more line\n")
    assert kernel_source(tree) != before


def test_a_file_outside_the_tree_kinds_does_not(tmp_path):
    tree = tmp_path / "kernels"
    shutil.copytree(KERNEL_DIR, tree)
    before = kernel_source(tree)
    (tree / "notes.txt").write_text("not a kernel source")
    assert kernel_source(tree) == before


def test_the_shared_numbers_come_from_one_table():
    """Every number the launching Python and the kernels share is written once, in gpu/constants.py:
    no kernel source defines one, and common.cuh stops a build that lacks any of them."""
    import re

    from moerun.backends.gpu.constants import SHARED, defines
    sources = {path.name: path.read_text() for path in KERNEL_DIR.iterdir() if path.suffix in (".cu", ".cuh")}
    defined = {(name, file) for file, text in sources.items() for name in SHARED
               if re.search(rf"^\s*#define\s+{name}\b", text, re.M)}
    assert defined == set()
    guard = re.search(r"#if (!defined.*?)\n#error", sources["common.cuh"], re.S).group(1)
    assert sorted(re.findall(r"!defined\((\w+)\)", guard)) == sorted(SHARED)
    used = {name for name in SHARED if any(re.search(rf"\b{name}\b", text) for file, text in sources.items()
                                            if file != "common.cuh")}
    assert used == set(SHARED)
    assert len(defines()) == len(SHARED) and all(re.fullmatch(r"-D\w+=\d+", option) for option in defines())
