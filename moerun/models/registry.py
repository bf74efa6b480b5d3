"""The supported architectures by their GGUF `general.architecture`: one module each, holding

- `RULE`: its ArchRule (what the backends' operations read of it);
- `read_spec(gguf, spec) -> ModelSpec`: what it reads of the metadata beyond the common keys;
- `layer(step, i, w, x) -> x`: layer i's computation, composed of moerun.models.blocks.

Adding an architecture is adding its module here."""
from __future__ import annotations

from types import ModuleType

from moerun.models import mixtral, olmoe, qwen2moe, qwen3moe, qwen35moe
from moerun.models.spec import ModelSpec

ARCHITECTURES: dict[str, ModuleType] = {module.RULE.gguf_arch: module
                                        for module in (qwen3moe, qwen2moe, olmoe, mixtral, qwen35moe)}
SUPPORTED = "qwen3moe, qwen2moe, olmoe, Mixtral (llama with experts) and qwen35moe"


def architecture(spec: ModelSpec) -> ModuleType:
    return ARCHITECTURES[spec.rule.gguf_arch]
