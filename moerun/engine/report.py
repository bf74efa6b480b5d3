"""Run telemetry: the `--stats` table and the `--stats-json` document (names in docs/stats.md)."""
from __future__ import annotations

from moerun.engine.runtime import RunStats, Runtime

MIB = 1 << 20


def stats_document(runtime: Runtime, run: RunStats, **extra) -> dict:
    daemons = []
    for link in runtime.rig.links if runtime.rig else []:
        counters = link.client.counters
        daemons.append({
            "name": link.name, "spec": link.spec, "endpoint": link.client.endpoint,
            "transport": link.transport, "state": "up" if link.up else f"down: {link.down_reason}",
            "calls": counters.calls, "mib_sent": counters.bytes_sent / MIB,
            "mib_received": counters.bytes_received / MIB, "parent_wait_ms": counters.wait_seconds * 1e3,
            "daemon_compute_ms": counters.compute_seconds * 1e3,
            "fallback_calls": link.fallback_calls, "times_down": link.times_down,
            "restarts": link.restarts, "rejoins": link.rejoins,
        })
    return {**extra, "model": str(runtime.gguf.path), **run.to_dict(), **runtime.moe_stats().to_dict(),
            "daemons": daemons}


def stats_table(doc: dict) -> str:
    lines = [
        f"prefill: {doc['prompt_tokens']} tokens in {doc['prefill_seconds']:.3f} s "
        f"({doc['prefill_tokens_per_second']:.2f} tokens/s)",
        f"decode:  {doc['decode_steps']} tokens in {doc['decode_seconds']:.3f} s "
        f"({doc['decode_tokens_per_second']:.2f} tokens/s)",
        f"MoE:     {doc['hot_only_layer_share']:.1%} of layer calls hot-only, "
        f"{doc['remote_pair_share']:.1%} of {doc['routed_pairs']} routed pairs remote, "
        f"{doc['fallback_pairs']} computed by the parent after a daemon failed",
    ]
    if doc["daemons"]:
        header = f"{'daemon':<14}{'transport':<10}{'calls':>8}{'MiB sent':>10}{'MiB recv':>10}" \
                 f"{'wait ms':>10}{'compute ms':>12}{'fallback':>10}{'down':>6}{'restarts':>10}{'rejoins':>9}  state"
        lines += ["", header]
        for d in doc["daemons"]:
            lines.append(f"{d['name']:<14}{d['transport']:<10}{d['calls']:>8}{d['mib_sent']:>10.2f}"
                         f"{d['mib_received']:>10.2f}{d['parent_wait_ms']:>10.1f}{d['daemon_compute_ms']:>12.1f}"
                         f"{d['fallback_calls']:>10}{d['times_down']:>6}{d['restarts']:>10}{d['rejoins']:>9}"
                         f"  {d['state']}")
    if "seed" in doc:
        lines.append(f"seed:    {doc['seed']}")
    return "\n".join(lines)
