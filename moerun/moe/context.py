"""The context a parent holds: the model's own, unless its KV cache and the attention work that
grows with the context would not fit what the parent's device has left beside its weights; then
the most that fits. A pure function of the numbers the backend reports (`Backend.context_memory`).
"""
from __future__ import annotations

from dataclasses import dataclass

from moerun.moe.planner import PlanError
from moerun.units import format_bytes

CONTEXT_STEP = 256              # a context cut to fit is a whole number of these
HEADROOM_BYTES = 1 << 30        # kept free beside the cache: activations, BLAS workspaces, graphs


@dataclass(frozen=True)
class ContextRoom:
    free_bytes: int             # what the parent's device has left after its weights
    kv_bytes: int               # one position's KV cache over all attention layers, in the cache's types
    work_bytes: int             # attention's scratch per cached position (a prefill chunk's scores and copies)
    kv_label: str               # the cache's types, for messages ("f16", "q8_0/f16")
    grows: bool                 # the cache grows with the sequence (the CPU's) instead of being allocated whole

    @property
    def largest(self) -> int:
        """The most positions whose cache and scratch fit beside the headroom."""
        return max(0, self.free_bytes - HEADROOM_BYTES) // (self.kv_bytes + self.work_bytes)


def choose_context(model_context: int, requested: int | None, pool: int | None,
                   room: ContextRoom) -> tuple[int, str | None]:
    """(context, the one line that says what was chosen and why; None where the --ctx or the
    model's context fits: nothing to say).
    Without --ctx: the model's context where its cache (or the --kv-pool's) fits, else the most
    that fits, in whole CONTEXT_STEPs. With it: that, or a PlanError naming the most that fits
    where the cache is allocated whole; a cache that grows is only warned about in the line."""
    largest = room.largest
    chosen = requested or (model_context if (pool or model_context) <= largest
                           else largest // CONTEXT_STEP * CONTEXT_STEP)
    held = min(pool or chosen, chosen)                    # positions whose memory a sequence may take
    needs = f"{format_bytes(held * room.kv_bytes)} of KV cache at {room.kv_label}"
    beside = f"{format_bytes(room.free_bytes)} free beside the weights"
    if held > largest and not room.grows:
        raise PlanError(f"{_what(requested, pool)} {held} tokens: {needs} (and attention's scratch) do not fit the "
                        f"{beside}; the most that fits is {largest} tokens. Lower --ctx, set --kv-pool, or use "
                        f"smaller KV types (-ctk q8_0 -ctv q8_0 on the CPU)")
    if chosen < 1:
        raise PlanError(f"no room for a KV cache: {beside}, {format_bytes(HEADROOM_BYTES)} of it kept for "
                        f"activations")
    if held > largest:
        return chosen, (f"context: {chosen} tokens; at full length {needs} would pass the {beside}, which the "
                        f"cache grows into")
    if requested or chosen == model_context:
        return chosen, None
    return chosen, (f"context: {chosen} of the model's {model_context} tokens, the most whose cache fits: {needs}, "
                    f"{beside} (--ctx or smaller KV types change it)")


def _what(requested: int | None, pool: int | None) -> str:
    if pool:
        return f"--kv-pool {pool}:"
    return f"--ctx {requested}:" if requested else "the model's context of"
