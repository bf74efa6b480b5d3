"""RigConfig: how the parent spreads experts over daemons, from command-line flags."""
from __future__ import annotations

import re
from dataclasses import dataclass

TRANSPORTS = ("auto", "shared", "stream")
MODES = ("auto", "batched", "stream")
PAYLOAD_DTYPES = ("f32", "f16", "bf16")
MAX_BATCH_CAPACITY = 4096
STREAM_SLICE_TOKENS = 4          # --mode stream: prefill tokens per call per daemon
AUTO = "auto"                    # --placement auto: plan from the devices' free memory at start-up

LOCAL_DEVICE = re.compile(r"^(cpu|cuda:\d+|hip:\d+)$")
REMOTE_ENDPOINT = re.compile(r"^(ipc://.+|tcp://[^:/]+:\d+)$")


class ConfigError(ValueError):
    """A flag value moerun cannot use; the message names the flag."""


@dataclass(frozen=True)
class RigConfig:
    daemons: tuple[str, ...] = ()        # cpu | cuda:N | hip:N (spawned) or ipc://… | tcp://… (connected)
    hot: int | None = None               # --hot N; None = the model's experts-per-token
    placement: str | None = None         # --placement FILE, or "auto"
    transport: str = "auto"
    mode: str = "auto"
    batch_capacity: int = 1024
    payload_dtype: str = "f32"
    daemon_timeout_s: float = 30.0
    require_daemons: bool = False

    def __post_init__(self) -> None:
        for spec in self.daemons:
            if not (LOCAL_DEVICE.match(spec) or REMOTE_ENDPOINT.match(spec)):
                raise ConfigError(f"--daemon {spec!r}: expected cpu, cuda:N, hip:N, ipc://PATH or tcp://HOST:PORT")
        checks = [
            (self.transport in TRANSPORTS, f"--transport must be one of {', '.join(TRANSPORTS)}"),
            (self.mode in MODES, f"--mode must be one of {', '.join(MODES)}"),
            (self.payload_dtype in PAYLOAD_DTYPES, f"--payload-dtype must be one of {', '.join(PAYLOAD_DTYPES)}"),
            (1 <= self.batch_capacity <= MAX_BATCH_CAPACITY,
             f"--batch-capacity must be between 1 and {MAX_BATCH_CAPACITY} (got {self.batch_capacity})"),
            (self.daemon_timeout_s > 0, f"--daemon-timeout must be > 0 (got {self.daemon_timeout_s})"),
            (self.hot is None or self.hot >= 0, f"--hot must be >= 0 (got {self.hot})"),
            (not (self.hot is not None and self.placement), "give --hot or --placement, not both"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def tokens_per_call(self) -> int:
        """Most tokens one prefill call to a daemon carries."""
        return STREAM_SLICE_TOKENS if self.mode == "stream" else self.batch_capacity
