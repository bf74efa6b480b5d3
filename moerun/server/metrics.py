"""What /metrics shows, in Prometheus text format (series described in docs/server.md).

Request and token series are updated by the worker as it works; daemon and MoE series are
read from the runtime's own counters at scrape time.
"""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moerun.engine.prefix_cache import PrefixCache
from moerun.engine.runtime import Runtime
from moerun.engine.speculative import SpecStats

OUTCOMES = ("stop", "length", "cancelled", "failed", "rejected")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("moerun_requests", "Requests ended, by outcome: stop, length (finish reasons), "
                                "cancelled (client gone), failed (server error), rejected (4xx/429/503)",
                                ["outcome"], registry=registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("moerun_prompt_tokens", "Prompt tokens (those resumed from a prefix snapshot "
                                     "included)", registry=registry)
        self.generation_tokens = Counter("moerun_generation_tokens", "Tokens generated", registry=registry)
        self.prompt_tokens_per_second = Gauge("moerun_prompt_tokens_per_second",
                                              "Prefill throughput of the last request", registry=registry)
        self.generation_tokens_per_second = Gauge("moerun_generation_tokens_per_second",
                                                  "Decode throughput of the last request", registry=registry)
        self.running = Gauge("moerun_requests_running", "Requests generating now (at most --parallel)",
                             registry=registry)
        self.queued = Gauge("moerun_requests_queued", "Requests waiting for their turn", registry=registry)
        self.time_to_first_token = Histogram("moerun_time_to_first_token_seconds",
                                             "From arrival to the first generated token, queueing included",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.request_duration = Histogram("moerun_request_duration_seconds",
                                          "From arrival to the last generated token, queueing included",
                                          buckets=LATENCY_BUCKETS, registry=registry)
        self.time_per_output_token = Histogram("moerun_time_per_output_token_seconds",
                                               "A request's time from its first token to its last, per token after "
                                               "the first", buckets=TOKEN_BUCKETS, registry=registry)
        self.spec_verify_steps = Counter("moerun_spec_verify_steps", "Speculative verify passes (--spec-type)",
                                         registry=registry)
        self.spec_drafted_tokens = Counter("moerun_spec_drafted_tokens", "Tokens drafted for verification",
                                           registry=registry)
        self.spec_accepted_tokens = Counter("moerun_spec_accepted_tokens", "Drafted tokens the sampler kept",
                                            registry=registry)
        self.spec_paused_steps = Counter("moerun_spec_paused_steps",
                                         "Plain decode steps while the gate held drafting back", registry=registry)
        self.batch_sequences = Histogram("moerun_batch_sequences", "Requests in each batched step (--parallel)",
                                         buckets=BATCH_BUCKETS, registry=registry)

    def count_speculation(self, spec: SpecStats) -> None:
        """A request's speculation counters, added at its end."""
        self.spec_verify_steps.inc(spec.verify_steps)
        self.spec_drafted_tokens.inc(spec.drafted_tokens)
        self.spec_accepted_tokens.inc(spec.accepted_tokens)
        self.spec_paused_steps.inc(spec.paused_steps)

    def watch(self, runtime: Runtime) -> None:
        """Show the loaded runtime's daemon and MoE counters from now on."""
        self.registry.register(RuntimeCollector(runtime))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# (family, name, help, value of one DaemonLink), one line per per-daemon series
DAEMON_SERIES = [
    (CounterMetricFamily, "moerun_daemon_calls", "Compute calls sent to the daemon",
     lambda link: link.client.counters.calls),
    (CounterMetricFamily, "moerun_daemon_sent_bytes", "Bytes sent to the daemon",
     lambda link: link.client.counters.bytes_sent),
    (CounterMetricFamily, "moerun_daemon_received_bytes", "Bytes received from the daemon",
     lambda link: link.client.counters.bytes_received),
    (CounterMetricFamily, "moerun_daemon_wait_seconds", "Time the parent waited for the daemon",
     lambda link: link.client.counters.wait_seconds),
    (CounterMetricFamily, "moerun_daemon_compute_seconds", "Time the daemon spent computing",
     lambda link: link.client.counters.compute_seconds),
    (CounterMetricFamily, "moerun_daemon_fallback_calls",
     "Calls the parent computed itself because the daemon was down",
     lambda link: link.fallback_calls),
    (GaugeMetricFamily, "moerun_daemon_up", "1 while the daemon is in use, 0 while it is marked down",
     lambda link: 1 if link.up else 0),
    (CounterMetricFamily, "moerun_daemon_times_down", "Times the daemon was marked down",
     lambda link: link.times_down),
    (CounterMetricFamily, "moerun_daemon_restarts", "Processes started to replace the daemon",
     lambda link: link.restarts),
    (CounterMetricFamily, "moerun_daemon_rejoins", "Times the daemon rejoined after being down",
     lambda link: link.rejoins),
]


# the same for each layer shard (a ShardLink)
SHARD_SERIES = [
    (CounterMetricFamily, "moerun_shard_steps", "FORWARD steps sent to the layer shard",
     lambda link: link.counters.calls),
    (CounterMetricFamily, "moerun_shard_sent_bytes", "Hidden-state bytes sent to the layer shard",
     lambda link: link.counters.bytes_sent),
    (CounterMetricFamily, "moerun_shard_received_bytes", "Hidden-state bytes received from the layer shard",
     lambda link: link.counters.bytes_received),
    (CounterMetricFamily, "moerun_shard_wait_seconds", "Time the parent waited for the layer shard",
     lambda link: link.counters.wait_seconds),
    (CounterMetricFamily, "moerun_shard_compute_seconds", "Time the layer shard spent on its layers",
     lambda link: link.counters.compute_seconds),
    (GaugeMetricFamily, "moerun_shard_up", "1 while the layer shard serves, 0 from a failed step to its restart",
     lambda link: 1 if link.broken is None else 0),
    (CounterMetricFamily, "moerun_shard_failures", "Steps the layer shard failed (each failed its request)",
     lambda link: link.times_down),
    (CounterMetricFamily, "moerun_shard_restarts", "Times the layer shard was started again",
     lambda link: link.restarts),
]


class RuntimeCollector:
    """Per-daemon IPC counters and state, per-shard steps and state, and the MoE dispatch
    counters, as they are at scrape time."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def collect(self):
        labels = ["daemon", "spec"]
        families = [(kind(name, text, labels=labels), value) for kind, name, text, value in DAEMON_SERIES]
        rig = self.runtime.rig
        for link in rig.links if rig else []:
            names = [link.label, link.spec]
            for family, value in families:
                family.add_metric(names, value(link))
        yield from (family for family, _ in families)

        shard_labels = ["shard", "spec", "layers"]
        families = [(kind(name, text, labels=shard_labels), value) for kind, name, text, value in SHARD_SERIES]
        shards = self.runtime.shards
        for link in shards.links if shards else []:
            names = [link.label, link.spec, f"{link.layers.start}-{link.layers.stop - 1}"]
            for family, value in families:
                family.add_metric(names, value(link))
        yield from (family for family, _ in families)

        yield from prefix_cache_series(self.runtime.prefix_cache)
        moe = self.runtime.moe_stats()
        yield CounterMetricFamily("moerun_moe_routed_pairs", "(token, expert) pairs routed", value=moe.routed_pairs)
        yield CounterMetricFamily("moerun_moe_remote_pairs", "Routed pairs sent to a daemon", value=moe.remote_pairs)
        yield CounterMetricFamily("moerun_moe_fallback_pairs", "Routed pairs the parent computed after a daemon failed",
                                  value=moe.fallback_pairs)
        for name, text, value in HOST_SERIES:
            yield CounterMetricFamily(name, text, value=value(moe.host))


HOST_SERIES = (      # name, help, value of the host-RAM experts' counts (a GPU parent with CPU daemons)
    ("moerun_moe_host_pairs", "Routed pairs to experts homed in host RAM", lambda c: c.host_pairs),
    ("moerun_expert_cache_hits", "Of those, computed from the parent's expert cache", lambda c: c.cache_hits),
    ("moerun_expert_cache_swaps", "Experts copied into the expert cache", lambda c: c.cache_swaps),
    ("moerun_expert_cache_bytes_in", "Bytes copied into the expert cache", lambda c: c.cache_bytes_in),
    ("moerun_stream_pairs", "Routed pairs computed by the parent from a streamed prefill layer",
     lambda c: c.streamed_pairs),
    ("moerun_read_pairs", "Routed pairs computed by the parent reading the weights in host RAM in place",
     lambda c: c.read_pairs),
    ("moerun_stream_layers", "Prefill layer calls that streamed their host-RAM experts", lambda c: c.streamed_layers),
    ("moerun_stream_bytes", "Bytes copied to the GPU for streamed prefill layers", lambda c: c.streamed_bytes),
)


def prefix_cache_series(cache: PrefixCache | None):
    """The prefix snapshots' counters (none without a prefix cache)."""
    if cache is None:
        return
    stats = cache.stats
    yield CounterMetricFamily("moerun_prefix_cache_lookups", "Prompts looked up among the prefix snapshots",
                              value=stats.lookups)
    yield CounterMetricFamily("moerun_prefix_cache_hits", "Prompts that resumed from a prefix snapshot",
                              value=stats.hits)
    yield CounterMetricFamily("moerun_prefix_cache_restored_tokens",
                              "Prompt tokens taken from snapshots, not prefilled", value=stats.restored_tokens)
    yield CounterMetricFamily("moerun_prefix_cache_snapshots", "Snapshots taken", value=stats.snapshots)
    yield CounterMetricFamily("moerun_prefix_cache_evictions", "Snapshots dropped for newer ones",
                              value=stats.evictions)
    yield GaugeMetricFamily("moerun_prefix_cache_entries", "Snapshots held now", value=len(cache))
    yield GaugeMetricFamily("moerun_prefix_cache_bytes", "Bytes the snapshots hold now", value=cache.nbytes)
    if cache.store is not None:
        yield CounterMetricFamily("moerun_prefix_cache_disk_hits",
                                  "Prompts that resumed from a snapshot read from disk", value=stats.disk_hits)
        yield GaugeMetricFamily("moerun_prefix_cache_disk_files", "Snapshot files in --prefix-cache-dir",
                                value=len(cache.store.files))
        yield GaugeMetricFamily("moerun_prefix_cache_disk_bytes", "Bytes of snapshot files in --prefix-cache-dir",
                                value=cache.store.nbytes)
