"""RigConfig: where the parent runs and how it spreads experts over daemons, as the
command-line flags or a config file (moerun.config) give it, checked once, here. The rig's
allowed values (transports with auto, modes) build on the ones the layers below define
(payload dtypes, batch capacity and endpoints in moerun.ipc, devices in moerun.backends).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

from moerun.backends.devices import DEVICE_PATTERN
from moerun.backends.kv_types import KV_TYPES, KVTypes, check_gpu_kv_types, default_kv_types
from moerun.errors import UsageError
from moerun.ipc.protocol import MAX_BATCH_CAPACITY, PAYLOAD_DTYPES, TRANSPORTS
from moerun.ipc.sockets import ENDPOINT

AUTO = "auto"                    # --transport, --mode auto: the first that fits; --placement auto: plan at start-up
OFF = "off"                      # --stream-threshold off: never stream prefill experts
RIG_TRANSPORTS = (AUTO, *TRANSPORTS)
MODES = (AUTO, "batched", "stream")
STREAM_SLICE_TOKENS = 4          # --mode stream: prefill tokens per call per daemon


class ConfigError(UsageError):
    """A flag or config-file value moerun cannot use; the message names the flag or key."""


class ProcessEntry:
    """What a [[daemon]] and a [[split]] table share: a `moerun daemon` process with a device
    and/or an endpoint, on a host, perhaps with CURVE keys."""
    device: str | None
    endpoint: str | None
    host: str | None
    curve_secret_key: str | None
    curve_authorized_keys: str | None

    @property
    def spec(self) -> str:
        """The process as --daemon or --split names it: the endpoint to connect to, else the device to spawn on."""
        return self.endpoint or self.device

    @property
    def curve_flags(self) -> tuple[str, ...]:
        """The `moerun daemon` flags that give it its CURVE keys, if it has them."""
        if self.curve_secret_key is None:
            return ()
        return ("--curve-secret-key", self.curve_secret_key, "--curve-authorized-keys", self.curve_authorized_keys)

    def runs_here(self) -> bool:
        """Whether it runs on this host: no host given, localhost, or this host's name."""
        return self.host in (None, "localhost", socket.gethostname()) or self.host == socket.getfqdn()


@dataclass(frozen=True)
class DaemonEntry(ProcessEntry):
    """One [[daemon]] table of a config file."""
    name: str
    device: str | None = None            # cpu | cuda:N | hip:N: the device it computes on
    endpoint: str | None = None          # ipc://… | tcp://…: where the parent reaches it [None: spawned]
    listen: str | None = None            # where it binds when moerun starts it [default: endpoint]
    host: str | None = None              # the host it runs on [default: the parent's]
    transport: str | None = None         # this daemon's transport [default: the rig's]
    memory: str | None = None            # its memory for `moerun plan`, e.g. 16GiB
    curve_public_key: str | None = None  # its CURVE public key file, for the parent
    curve_secret_key: str | None = None  # its CURVE secret key file, on its host
    curve_authorized_keys: str | None = None   # the public key file (or directory) of the parents it serves
    threads: int | None = None           # a CPU daemon's threads [default: its share of this host's CPUs]
    numa_node: int | None = None         # a CPU daemon held to this NUMA node's CPUs

    @property
    def node_flags(self) -> tuple[str, ...]:
        """The `moerun daemon` flags that hold it to its NUMA node, if it has one."""
        return () if self.numa_node is None else ("--numa-node", str(self.numa_node))


@dataclass(frozen=True)
class SplitEntry(ProcessEntry):
    """One [[split]] table of a config file: a layer shard and the first layer it runs."""
    name: str
    layer: int
    device: str | None = None            # cpu | cuda:N | hip:N: where it runs
    endpoint: str | None = None          # ipc://… | tcp://…: where the parent reaches it [None: spawned]
    listen: str | None = None            # where it binds when moerun starts it [default: endpoint]
    host: str | None = None              # the host it runs on [default: the parent's]
    curve_public_key: str | None = None  # its CURVE public key file, for the parent
    curve_secret_key: str | None = None  # its CURVE secret key file, on its host
    curve_authorized_keys: str | None = None   # the public key file (or directory) of the parents it serves
    daemons: tuple[str, ...] = ()        # its own expert daemons (moerun daemon --layers A:B --daemon SPEC)
    hot: int | None = None               # with daemons: its hot experts per layer (--hot)

    @property
    def expert_flags(self) -> tuple[str, ...]:
        """The `moerun daemon` flags that give it its own expert daemons, if it has them."""
        daemons = tuple(flag for spec in self.daemons for flag in ("--daemon", spec))
        return daemons + (("--hot", str(self.hot)) if self.hot is not None else ())


def shard_flags(layers: range, ctx: int) -> tuple[str, ...]:
    """The `moerun daemon` flags that make it the layer shard of `layers` for `ctx` positions."""
    return ("--layers", f"{layers.start}:{layers.stop}", "--ctx", str(ctx))


def kv_types_on(device: str, both: str | None, key: str | None, value: str | None) -> KVTypes:
    """The KV types of a cache on `device`: each side's own flag, else `both` (--kv-dtype), else the device's."""
    default = default_kv_types(device)
    return KVTypes(key or both or default.key, value or both or default.value)


@dataclass(frozen=True)
class RigConfig:
    daemons: tuple[str, ...] = ()        # cpu | cuda:N | hip:N (spawned) or ipc://… | tcp://… (connected)
    hot: int | None = None               # --hot N; None = the model's experts-per-token
    placement: str | None = None         # --placement FILE, or "auto"
    transport: str = "auto"
    mode: str = "auto"
    batch_capacity: int = 1024
    payload_dtype: str | None = None     # activations to daemons and shards; None: f32, bf16 between GPU and GPU shard
    daemon_timeout_s: float = 30.0
    require_daemons: bool = False
    device: str = "cpu"                  # the parent's: cpu | cuda:N | hip:N
    graphs: bool = True                  # --no-graph: GPU decode steps run eagerly instead of as CUDA graphs
    kv_dtype: str | None = None          # --kv-dtype: the KV cache's keys and values (kv_types.KV_TYPES);
                                         # None: the device's default (f32 on the CPU, f16 on a GPU)
    cache_type_k: str | None = None      # --cache-type-k / -ctk: the keys' alone (over kv_dtype)
    cache_type_v: str | None = None      # --cache-type-v / -ctv: the values' alone
    daemon_entries: tuple[DaemonEntry, ...] = ()   # the config file's [[daemon]] tables behind `daemons`, if any
    split_entries: tuple[SplitEntry, ...] = ()     # the config file's [[split]] tables behind `splits`, if any
    client_secret_key: str | None = None           # the parent's CURVE secret key file (--curve-secret-key, [auth])
    daemon_public_keys: tuple[str, ...] = ()       # --daemon-public-key: the connected daemons' public key files
    threads: int | None = None           # the parent's CPU threads [default: its share of this host's CPUs]
    pin: bool = False                    # hold the parent and its CPU daemons to their own cores
    splits: tuple[tuple[str, int], ...] = ()   # (shard, first layer): --split SPEC@LAYER, boundaries ascending
    split_auto: bool = False             # --split auto: layer ranges over this host's GPUs by their free memory
    stream_threshold: str = AUTO         # a GPU parent's prefill chunks of this many tokens compute the CPU
                                         # daemons' experts from copies: N, auto (by measurement) or off
    expert_cache_bytes: int = 0          # --expert-cache: a GPU parent's device memory for host-RAM experts
    gpu_reads: str = OFF                 # the share (0..1) of the host-RAM experts a GPU parent reads in
                                         # place, or off

    def __post_init__(self) -> None:
        for spec in self.daemons:
            if not (DEVICE_PATTERN.match(spec) or ENDPOINT.match(spec)):
                raise ConfigError(f"--daemon {spec!r}: expected cpu, cuda:N, hip:N, ipc://PATH or tcp://HOST:PORT")
        for spec, layer in self.splits:
            if not (DEVICE_PATTERN.match(spec) or ENDPOINT.match(spec)) or layer < 1:
                raise ConfigError(f"--split {spec}@{layer}: expected SPEC@LAYER with SPEC cpu, cuda:N, hip:N, "
                                  f"ipc://PATH or tcp://HOST:PORT and LAYER >= 1 (the parent runs the layers "
                                  f"before it)")
        if self.split_auto and self.splits:
            raise ConfigError("--split auto places every boundary itself: give it alone")
        for flag, name in (("--kv-dtype", self.kv_dtype), ("--cache-type-k", self.cache_type_k),
                           ("--cache-type-v", self.cache_type_v)):
            if name not in (None, *KV_TYPES):
                raise ConfigError(f"{flag} must be one of {', '.join(KV_TYPES)}")
        if DEVICE_PATTERN.match(self.device) and self.device != "cpu":
            check_gpu_kv_types(self.kv_cache_types)
        layers = [layer for _, layer in self.splits]
        if layers != sorted(set(layers)):
            raise ConfigError(f"--split boundaries must be distinct layers in ascending order (got {layers})")
        checks = [
            (bool(DEVICE_PATTERN.match(self.device)), f"--device {self.device!r}: expected cpu, cuda:N or hip:N"),
            (self.transport in RIG_TRANSPORTS, f"--transport must be one of {', '.join(RIG_TRANSPORTS)}"),
            (self.mode in MODES, f"--mode must be one of {', '.join(MODES)}"),
            (self.payload_dtype in (None, *PAYLOAD_DTYPES),
             f"--payload-dtype must be one of {', '.join(PAYLOAD_DTYPES)}"),
            (1 <= self.batch_capacity <= MAX_BATCH_CAPACITY,
             f"--batch-capacity must be between 1 and {MAX_BATCH_CAPACITY} (got {self.batch_capacity})"),
            (self.daemon_timeout_s > 0, f"--daemon-timeout must be > 0 (got {self.daemon_timeout_s})"),
            (self.stream_threshold in (AUTO, OFF)
             or (self.stream_threshold.isdigit() and int(self.stream_threshold) >= 1),
             f"--stream-threshold must be a number of tokens (>= 1), auto or off (got {self.stream_threshold!r})"),
            (self.expert_cache_bytes >= 0, f"--expert-cache must be >= 0 (got {self.expert_cache_bytes})"),
            (self.gpu_reads == OFF or _share(self.gpu_reads) is not None,
             f"--gpu-reads must be a share between 0 and 1, or off (got {self.gpu_reads!r})"),
            (self.hot is None or self.hot >= 0, f"--hot must be >= 0 (got {self.hot})"),
            (self.threads is None or self.threads >= 1, f"--threads must be >= 1 (got {self.threads})"),
            (not (self.hot is not None and self.placement), "give --hot or --placement, not both"),
            (not (self.placement and not self.daemons),
             f"--placement {self.placement} places experts on daemons, but no --daemon (or [[daemon]] table) "
             f"was given: give the daemons it was made for, or drop --placement"),
            (not self.daemon_entries or tuple(entry.spec for entry in self.daemon_entries) == self.daemons,
             "the [[daemon]] tables do not match the --daemon list"),
            (not self.split_entries or tuple((entry.spec, entry.layer) for entry in self.split_entries) == self.splits,
             "the [[split]] tables do not match the --split list"),
            (not self.daemon_public_keys or self._connected(),
             "--daemon-public-key is for the daemons the parent connects to (--daemon or --split ipc://… or "
             "tcp://…); a daemon it spawns needs no keys"),
            (len(self.daemon_public_keys) in (0, 1, len(self._connected())),
             f"--daemon-public-key is given {len(self.daemon_public_keys)} times for the {len(self._connected())} "
             f"daemons the parent connects to: give one for each, in the order of --daemon then --split, or one "
             f"for all"),
            (not self.daemon_public_keys or self.client_secret_key is not None,
             "--daemon-public-key needs this parent's own key pair: give --curve-secret-key FILE (or [auth] "
             "client_secret_key in the config; `moerun keys -o DIR` makes a pair)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def curve_public_key(self, table: str, index: int) -> str | None:
        """The CURVE public key file of daemon ("daemon") or layer shard ("split") `index`, when the
        parent connects to it: from --daemon-public-key (one for each such process, daemons first,
        or one for all), else its config table's curve_public_key; None: no CURVE."""
        return self._public_keys().get((table, index))

    def _connected(self) -> list[tuple[str, int]]:
        """The daemons and shards the parent connects to (an endpoint, not a device), in order."""
        return ([("daemon", i) for i, spec in enumerate(self.daemons) if ENDPOINT.match(spec)]
                + [("split", i) for i, (spec, _) in enumerate(self.splits) if ENDPOINT.match(spec)])

    def _public_keys(self) -> dict[tuple[str, int], str]:
        connected = self._connected()
        if self.daemon_public_keys:
            files = self.daemon_public_keys * len(connected) if len(self.daemon_public_keys) == 1 \
                else self.daemon_public_keys
            return dict(zip(connected, files))
        tables = [*((("daemon", i), entry) for i, entry in enumerate(self.daemon_entries)),
                  *((("split", i), entry) for i, entry in enumerate(self.split_entries))]
        return {place: entry.curve_public_key for place, entry in tables
                if entry.curve_public_key is not None and place in connected}

    @property
    def kv_cache_types(self) -> KVTypes:
        """The parent's KV cache elements: -ctk/-ctv, else --kv-dtype, else its device's own."""
        return kv_types_on(self.device, self.kv_dtype, self.cache_type_k, self.cache_type_v)

    @property
    def expert_payload_dtype(self) -> str:
        """The activations sent to expert daemons: --payload-dtype, else f32."""
        return self.payload_dtype or "f32"

    def shard_payload_dtype(self, shard: str) -> str:
        """The hidden state to and from a layer shard on `shard` (a device, or an endpoint):
        --payload-dtype, else bf16 between a GPU parent and a shard spawned on a GPU, else f32."""
        both_gpus = self.device != "cpu" and DEVICE_PATTERN.match(shard) is not None and shard != "cpu"
        return self.payload_dtype or ("bf16" if both_gpus else "f32")

    @property
    def stream_tokens(self) -> int | str | None:
        """--stream-threshold as the dispatcher takes it: tokens, AUTO, or None (off)."""
        if self.stream_threshold == OFF:
            return None
        return AUTO if self.stream_threshold == AUTO else int(self.stream_threshold)

    @property
    def read_share(self) -> float | None:
        """--gpu-reads as the dispatcher takes it: a share, or None (off)."""
        return None if self.gpu_reads == OFF else _share(self.gpu_reads)

    @property
    def tokens_per_call(self) -> int:
        """Most tokens one prefill call to a daemon carries."""
        return STREAM_SLICE_TOKENS if self.mode == "stream" else self.batch_capacity


def _share(text: str) -> float | None:
    """'0.5' -> 0.5; None for anything that is not a number from 0 to 1."""
    try:
        share = float(text)
    except ValueError:
        return None
    return share if 0.0 <= share <= 1.0 else None


def parse_split(text: str) -> tuple[str, int]:
    """SPEC@LAYER (--split, a [[split]] table) -> (SPEC, LAYER); ConfigError when malformed."""
    spec, at, layer = text.rpartition("@")
    if not at or not spec or not layer.isdigit():
        raise ConfigError(f"--split {text!r}: expected SPEC@LAYER, e.g. cuda:1@24 (layers 24.. on cuda:1)")
    return spec, int(layer)
