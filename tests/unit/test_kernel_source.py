"""The GPU kernels' source as CuPy is given it: a change in any file of the kernel tree, headers
included, changes the code CuPy keys its cache of compiled modules by."""
from __future__ import annotations

import shutil

from moerun.backends.gpu_kernels import KERNEL_DIR, kernel_source


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
