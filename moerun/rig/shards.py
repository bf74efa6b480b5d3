"""Layer shards as the parent sees them (--split SPEC@LAYER): the layers from each boundary to
the next run in a shard process (`moerun daemon --layers A:B`, moerun.daemons.shard),
spawned here on cpu, cuda:N or hip:N, or reached at an ipc:// or tcp:// endpoint; the parent
keeps the embedding, the layers before the first boundary and the head. A step's hidden
state [T, H] goes through the shards in order: to shards on GPUs of the parent's vendor on
this host device to device (transport "device": the shard's buffers opened through IPC, the
order kept by IPC events, a doorbell each way in a one-slot arena, f32), else through the
host: a one-slot shared arena to a shard on this host, its socket to one elsewhere, in each
shard's payload dtype. moerun.rig.transport decides, as for expert daemons.

A shard that dies or stops answering fails the step in flight with ShardFailed (its KV cache
is gone with it, so the request cannot go on); the next sequence restarts it (a spawned one
as a new process, a connected one with a new HELLO) and prefills from position 0.
Shape legend: T tokens, H hidden.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import zmq

from moerun.backends.devices import DEVICE_PATTERN, gpu_module, parse_device
from moerun.backends.gpu.ipc import TransportUnavailable, record, wait
from moerun.ipc.client import Counters, DaemonClient
from moerun.ipc.curve import CurveClientKeys
from moerun.ipc.protocol import MAX_BATCH_CAPACITY
from moerun.models.spec import ModelSpec
from moerun.moe.layer_split import explain_split, layer_bytes, split_layers
from moerun.moe.planner import DeviceBudget
from moerun.rig.gpu.channels import Attached, GpuAttachments
from moerun.rig.links import DAEMON_FAILURES, RigError, failure_reason
from moerun.rig.settings import RigConfig, SplitEntry, kv_types_on, shard_flags
from moerun.rig.spawn import LocalDaemon, make_run_dir, remove_run_dir, spawn_daemon
from moerun.rig.transport import Facts, choose_transport

SHARD_START_TIMEOUT_S = 300.0        # a spawned shard loads its layers before it answers HELLO
AUTO_RESERVE_BYTES = 1 << 30         # --split auto keeps this much of each GPU free (workspace, graphs, allocator)

logger = logging.getLogger(__name__)
Answer = TypeVar("Answer")


class ShardFailed(RigError):
    """A layer shard failed a step: the request in flight cannot go on."""


@dataclass
class ShardLink:
    index: int
    spec: str                          # cpu | cuda:N | hip:N (spawned) or ipc://… | tcp://… (connected)
    layers: range
    label: str = ""                    # its [[split]] table's name; "": s<index>
    client: DaemonClient | None = None
    local: LocalDaemon | None = None
    broken: str | None = None          # why it failed; it restarts before the next sequence
    restarts: int = 0
    times_down: int = 0
    counters: Counters = field(default_factory=Counters)    # its clients' calls, bytes and waits, over restarts
    dtype: str = "f32"                 # the hidden state's payload dtype (through the host)
    device: Attached | None = None     # transport "device": the parent's event, the shard's buffers

    def __post_init__(self) -> None:
        self.label = self.label or f"s{self.index}"

    @property
    def name(self) -> str:
        return f"{self.label} {self.spec} layers {self.layers.start}-{self.layers.stop - 1}"

    def alive(self) -> bool:
        return self.local.alive() if self.local else True


class LayerShards:
    def __init__(self, config: RigConfig, model_path: str | Path, fingerprint: str, spec: ModelSpec, ctx: int,
                 chunk: int, backend):
        """ctx: the positions each shard's KV cache holds (the parent's); chunk: the most tokens
        one step carries (the parent's prefill chunk), which a shard's arena holds; backend:
        the parent's."""
        boundaries = [layer for _, layer in config.splits]
        for shard_spec, layer in config.splits:
            if layer >= spec.n_layers:
                raise RigError(f"--split {shard_spec}@{layer}: the model has layers 0..{spec.n_layers - 1}, "
                               f"so a shard starts at a layer from 1 to {spec.n_layers - 1}")
        ends = [*boundaries[1:], spec.n_layers]
        self.config, self.model_path, self.fingerprint, self.ctx = config, model_path, fingerprint, ctx
        self.chunk, self.hidden = chunk, spec.hidden
        labels = [entry.name for entry in config.split_entries] or [""] * len(config.splits)
        self.links = [ShardLink(i, shard_spec, range(layer, end), label, dtype=config.shard_payload_dtype(shard_spec))
                      for i, ((shard_spec, layer), end, label) in enumerate(zip(config.splits, ends, labels))]
        self.sequence = 0
        self.backend = backend
        self.attachments = GpuAttachments(backend) if backend.kind != "CPU" else None
        self.run_dir = make_run_dir()
        self.context = zmq.Context()
        try:
            for link in self.links:
                self._start(link)
        except BaseException:
            self.close()
            raise

    @property
    def first_layer(self) -> int:
        """The first layer on a shard: the parent runs the ones before it."""
        return self.links[0].layers.start

    def begin_sequence(self) -> None:
        """A new sequence (its steps start at position 0): broken shards restart first, and so
        do spawned ones whose process ended since the last step (no request need fail for them)."""
        for link in self.links:
            if link.broken is None and not link.alive():
                link.broken = "died"
                link.times_down += 1
                logger.warning(f"layer shard {link.name} died between requests")
            if link.broken is not None:
                self._restart(link)
        self.sequence += 1

    def hop(self, x, start: Callable[[], int]):
        """x [T, H] on the parent's backend at positions start().. of the current sequence
        through every shard -> [T, H] there: device to device where every shard takes it so,
        else through the host (the backend's hop)."""
        if not all(link.device is not None for link in self.links):
            return self.backend.hop(x, lambda hidden: self.forward(hidden, start()))
        for link in self.links:
            buffers, tokens = link.device.imported.address, len(x)
            x = self.backend.device.hop_through(
                x, buffers, buffers + self.chunk * self.hidden * 4,
                lambda link=link, tokens=tokens: self._device_step(link, start(), tokens))
        return x

    def graph_key(self) -> tuple:
        """What a captured step's device-direct hops depend on: the buffers of each shard's
        process (a restarted shard exports new ones)."""
        return tuple(link.restarts for link in self.links if link.device is not None)

    def forward(self, x: np.ndarray, start: int) -> np.ndarray:
        """x f32 [T, H] at positions start.. of the current sequence through every shard -> [T, H]."""
        timeout_s = self.config.daemon_timeout_s
        for link in self.links:
            x = self._step(link, lambda: link.client.forward(self.sequence, start, x, link.dtype, timeout_s,
                                                             link.alive))
        return x

    def _device_step(self, link: ShardLink, start: int, tokens: int) -> None:
        """A shard's step whose state is in its device buffers: the parent's event after its
        copy, the request, the shard's answer once its work is queued, then this stream waits
        for the shard's event (no host waits for either device)."""
        cupy, stream, timeout_s = self.backend.device.cupy, self.backend.device.stream, self.config.daemon_timeout_s

        def post_and_collect() -> None:
            record(cupy, link.device.incoming[0], stream)
            link.client.collect(link.client.post_forward(self.sequence, start, tokens), timeout_s, link.alive)

        self._step(link, post_and_collect)
        wait(cupy, stream, link.device.imported.outgoing[0])

    def _step(self, link: ShardLink, request: Callable[[], Answer]) -> Answer:
        """request()'s answer from a shard; ShardFailed when it is broken or fails now."""
        if link.broken is not None:
            raise ShardFailed(self._failure(link))
        try:
            return request()
        except DAEMON_FAILURES as err:
            link.broken = failure_reason(err, self.config.daemon_timeout_s)
            link.times_down += 1
            logger.warning(f"layer shard {link.name} {link.broken}")
            raise ShardFailed(self._failure(link)) from None

    def _failure(self, link: ShardLink) -> str:
        return (f"layer shard {link.name} {link.broken}: the request fails (its KV cache is gone); the shard "
                f"restarts and the next request prefills again")

    def _start(self, link: ShardLink) -> None:
        spawned = DEVICE_PATTERN.match(link.spec) is not None
        if spawned:
            device = link.spec.split(":")[0]
            kv = kv_types_on(device, self.config.kv_dtype, self.config.cache_type_k, self.config.cache_type_v)
            link.local = spawn_daemon(
                link.spec, self.model_path, f"ipc://{self.run_dir}/shard-{link.index}.sock",
                self.run_dir / f"shard-{link.index}.log",
                extra_args=(*shard_flags(link.layers, self.ctx), *self._expert_flags(link),
                            "--cache-type-k", kv.key, "--cache-type-v", kv.value,
                            *(() if self.config.graphs else ("--no-graph",))))
        endpoint = link.local.endpoint if link.local else link.spec
        timeout_s = SHARD_START_TIMEOUT_S if spawned else self.config.daemon_timeout_s
        link.client = DaemonClient(endpoint, context=self.context, connect_timeout_s=timeout_s,
                                   curve=self._curve_keys(link), expect_listening=not spawned)
        link.client.counters = link.counters
        started = time.monotonic()
        try:
            info = link.client.hello(self.fingerprint, link.alive, model=str(self.model_path))
        except DAEMON_FAILURES as err:
            tail = f"; its log ends:\n{link.local.stderr_tail()}" if link.local else ""
            raise RigError(f"layer shard {link.name} did not start: {err}{tail}") from None
        if info.get("layers") != [link.layers.start, link.layers.stop]:
            raise RigError(f"layer shard {link.name} at {endpoint} runs layers {info.get('layers')}, not "
                           f"{link.layers.start}:{link.layers.stop} (start it with --layers "
                           f"{link.layers.start}:{link.layers.stop})")
        if info.get("ctx", 0) < self.ctx:
            raise RigError(f"layer shard {link.name} at {endpoint} holds {info.get('ctx')} positions, the parent "
                           f"needs {self.ctx} (start it with --ctx {self.ctx})")
        self._attach(link)
        link.broken = None
        logger.info(f"layer shard {link.name} ready in {time.monotonic() - started:.1f} s "
                    f"({link.client.transport} transport)")

    def _attach(self, link: ShardLink) -> None:
        """A shard on this host takes its steps through a shared arena of one slot (a doorbell
        each way instead of a socket round trip), its hidden state in the arena or, device to
        device, in the shard's buffers (moerun.rig.transport decides; --transport stream: none)."""
        if self.config.transport == "stream" or not link.client.same_host() or self.chunk > MAX_BATCH_CAPACITY:
            return
        layout = dict(batch_capacity=self.chunk, hidden=self.hidden, max_pairs_per_token=1, slots=1)
        facts = Facts(link.name, self.config.transport, True, self.config.device,
                      str(link.client.info.get("device", "cpu")), parent_maps_arena=False)
        try:
            choice = choose_transport(facts)
            if choice.transport == "device":
                try:
                    self.attachments.attach_device(link, **layout)
                    link.device = self.attachments.attached[link.index]
                    return
                except TransportUnavailable as err:
                    choice = choose_transport(facts, device_failure=str(err))
                    logger.info(choice.note)
            link.client.attach_shared(**layout, alive=link.alive)
        except DAEMON_FAILURES as err:
            raise RigError(f"layer shard {link.name} could not map the shared arena: {err}") from None

    def _curve_keys(self, link: ShardLink) -> CurveClientKeys | None:
        """The CURVE keys for a shard, when the rig names its public key."""
        public_key = self.config.curve_public_key("split", link.index)
        if public_key is None:
            return None
        return CurveClientKeys.from_files(self.config.client_secret_key, public_key)

    def _expert_flags(self, link: ShardLink) -> tuple[str, ...]:
        """A spawned shard's own expert daemons, as its [[split]] table gives them."""
        entry = self._entry(link)
        return () if entry is None else entry.expert_flags

    def _entry(self, link: ShardLink) -> SplitEntry | None:
        """The shard's [[split]] table; None when the shards came from flags."""
        entries = self.config.split_entries
        return entries[link.index] if entries else None

    def _restart(self, link: ShardLink) -> None:
        """A spawned shard is stopped (it may only hang) and started again; a connected one greeted again."""
        self._drop(link)
        link.restarts += 1
        try:
            self._start(link)
        except (RigError, TransportUnavailable) as err:
            raise ShardFailed(str(err)) from None

    def _drop(self, link: ShardLink) -> None:
        if link.device is not None:
            self.attachments.release_link(link)
            link.device = None
        if link.client is not None:
            link.client.close()
            link.client = None
        if link.local is not None:
            link.local.stop()
            link.local = None

    def close(self) -> None:
        """BYE to every shard that answers, stop the spawned ones; never blocks on ZeroMQ."""
        try:
            for link in self.links:
                if link.client is not None and link.broken is None:
                    try:
                        link.client.bye()
                    except DAEMON_FAILURES:
                        pass
                self._drop(link)
        finally:
            self.context.destroy(linger=0)   # only the thread that runs the steps used it
            remove_run_dir(self.run_dir)


def auto_splits(gguf, spec: ModelSpec, config: RigConfig, context: int) -> tuple[tuple[str, int], ...]:
    """--split auto: the parent's GPU and the others of its platform on this host, their layer
    ranges by free memory (moerun.moe.layer_split); () when every layer fits the parent."""
    parent = parse_device(config.device)
    if parent.platform == "cpu":
        raise RigError("--split auto spreads the layers over this host's GPUs, and the parent runs on the CPU: "
                       "give --device cuda:N (or hip:N), or name each shard (--split cpu@LAYER)")
    cupy = gpu_module(parent)
    devices = []
    for index in [parent.index, *(i for i in range(cupy.cuda.runtime.getDeviceCount()) if i != parent.index)]:
        with cupy.cuda.Device(index):
            free, _ = cupy.cuda.runtime.memGetInfo()
        devices.append(DeviceBudget(f"{parent.platform}:{index}", free, is_parent=index == parent.index))
    sizes = layer_bytes(gguf, spec, context, config.kv_cache_types)
    ranges = split_layers(sizes, devices, AUTO_RESERVE_BYTES)
    logger.info("--split auto: " + "; ".join(explain_split(ranges).splitlines()))
    return tuple((r.device.name, r.layers.start) for r in ranges[1:])
