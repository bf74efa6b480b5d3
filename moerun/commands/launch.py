"""`moerun launch --config FILE`: start the daemons and layer shards a rig config names on this
host, then run its workload, a generation (`moerun run`) or the OpenAI server (`moerun serve`).

A [[daemon]] or [[split]] with a device and no endpoint is spawned by the parent itself, as
`--daemon cpu` is. One with a device and an endpoint on this host is started here first,
listening on its endpoint (or `listen`), and the parent connects to it; if it exits it is
started again. A layer shard is started with its layers (from its `layer` to the next table's)
and the run's context. Every process started is a child that dies with this process
(parent-death signal).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click
from click.core import ParameterSource

from moerun.commands.options import friendly_errors
from moerun.config import load_config_file
from moerun.engine.runtime import DEFAULT_CONTEXT
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.rig.cores import share_host
from moerun.rig.links import RigError
from moerun.rig.settings import ProcessEntry, RigConfig, SplitEntry, shard_flags
from moerun.rig.spawn import (
    LocalDaemon,
    make_run_dir,
    remove_run_dir,
    spawn_daemon,
)

WORKLOAD_COMMANDS = {"generate": "run", "serve": "serve"}
START_TIMEOUT_S = 60.0
RESTART_FIRST_S, RESTART_MAX_S = 0.5, 30.0
POLL_S = 0.05

logger = logging.getLogger(__name__)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help="Rig config file (TOML, docs/config.md).")
@click.argument("workload_flags", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
@friendly_errors
def launch(ctx, config_file, workload_flags):
    """Start the rig a config file describes and run its workload.

    Daemons the file gives a device and an endpoint on this host are started first; the
    parent spawns those with a device only. Flags after --config FILE are those of
    `moerun run` (workload = "generate") or `moerun serve` (workload = "serve") and
    override the file."""
    parent_key_given = any(flag.partition("=")[0] == "--curve-secret-key" for flag in workload_flags)
    values = load_config_file(config_file, parent_key_given=parent_key_given)
    group = ctx.find_root()
    workload = group.command.get_command(group, WORKLOAD_COMMANDS[values.get("workload", "generate")])
    with workload.make_context(f"{group.info_name} launch", ["--config", config_file, *workload_flags],
                               parent=group) as command:
        entries = () if _overridden(command, "daemons") else values.get("daemon_entries", ())
        splits = () if _overridden(command, "splits") else values.get("split_entries", ())
        model = command.params["model"] or values.get("model")
        if model is None and any(map(_starts_here, (*entries, *splits))):
            from moerun.writers.demo import demo_model_path
            model = demo_model_path()
        # the parent divides the host's CPUs the same way when it starts: these daemons are in its split
        rig = RigConfig(daemons=tuple(entry.spec for entry in entries), daemon_entries=entries,
                        **{name: _setting(command, values, name) for name in ("device", "threads", "pin")})
        cpus = share_host(rig)
        to_start = [ToStart(entry.name, entry.device, entry.listen or entry.endpoint,
                            (*entry.curve_flags, *entry.node_flags), cpus.spawn_settings(i))
                    for i, entry in enumerate(entries) if _starts_here(entry)]
        context = _setting(command, values, "kv_pool") or _setting(command, values, "ctx")
        to_start += _shards_to_start(splits, model, context)
        with StartedDaemons(to_start, model):
            workload.invoke(command)


@dataclass(frozen=True)
class ToStart:
    """A daemon or layer shard launch starts: `moerun daemon` on `device`, listening on `listen`."""
    name: str
    device: str
    listen: str
    extra_args: tuple[str, ...]
    cpu_settings: dict                 # spawn_daemon's threads and cpus


def _starts_here(entry: ProcessEntry) -> bool:
    """A daemon or shard with a device and an endpoint on this host: launch starts it."""
    return bool(entry.endpoint and entry.device and entry.runs_here())


def _overridden(command: click.Context, name: str) -> bool:
    return command.get_parameter_source(name) is ParameterSource.COMMANDLINE


def _shards_to_start(splits: tuple[SplitEntry, ...], model, ctx: int | None) -> list[ToStart]:
    """The [[split]] shards with a device and an endpoint on this host, with their layers
    (to the next table's first, the last to the model's end) and the run's context."""
    here = [entry for entry in splits if _starts_here(entry)]
    if not here:
        return []
    with GGUFFile(model) as gguf:
        spec = load_spec(gguf)
    ctx = ctx or min(spec.context_train, DEFAULT_CONTEXT)
    ends = [*(entry.layer for entry in splits[1:]), spec.n_layers]
    return [ToStart(entry.name, entry.device, entry.listen or entry.endpoint,
                    (*shard_flags(range(entry.layer, end), ctx), *entry.expert_flags, *entry.curve_flags), {})
            for entry, end in zip(splits, ends) if entry in here]


class StartedDaemons:
    """The daemons and shards launch starts: each waited for until it listens, restarted with
    back-off when it exits (the parent then brings it back in), all stopped at the end."""

    def __init__(self, entries: list[ToStart], model: str | Path):
        self.entries = entries
        self.model = model
        self.run_dir = make_run_dir()
        self.made_folders: list[Path] = []        # socket folders made here, removed at the end if empty
        self.daemons: dict[str, LocalDaemon] = {}
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="moerun-launch-watch", daemon=True)

    def __enter__(self) -> StartedDaemons:
        try:
            since_ns = time.time_ns()
            for entry in self.entries:
                self._spawn(entry)
            deadline = time.monotonic() + START_TIMEOUT_S
            for entry in self.entries:
                _wait_until_listening(entry, self.daemons[entry.name], since_ns, deadline)
        except BaseException:
            self.__exit__()
            raise
        self.watcher.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopping.set()
        if self.watcher.is_alive():
            self.watcher.join()
        for daemon in self.daemons.values():
            daemon.stop()
        remove_run_dir(self.run_dir)
        for folder in reversed(self.made_folders):
            with contextlib.suppress(OSError):      # not empty: someone else's files are there too
                folder.rmdir()

    def _spawn(self, entry: ToStart) -> None:
        if entry.listen.startswith("ipc://"):
            self._make_folder(Path(entry.listen.removeprefix("ipc://")).parent)
        self.daemons[entry.name] = spawn_daemon(entry.device, self.model, entry.listen,
                                                self.run_dir / f"{entry.name}.log", **entry.cpu_settings,
                                                extra_args=entry.extra_args)

    def _make_folder(self, folder: Path) -> None:
        """The folder and its missing parents (0700), remembered to be removed at the end."""
        missing = []
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            folder.mkdir(mode=0o700, exist_ok=True)
            self.made_folders.append(folder)

    def _watch(self) -> None:
        """Start again a daemon that exits: after RESTART_FIRST_S, twice as late each time it
        exits again within RESTART_MAX_S of its start, at most RESTART_MAX_S."""
        delays = {entry.name: RESTART_FIRST_S for entry in self.entries}
        started = dict.fromkeys(delays, time.monotonic())
        while not self.stopping.wait(POLL_S):
            for entry in self.entries:
                daemon = self.daemons[entry.name]
                if daemon.alive():
                    continue
                if time.monotonic() - started[entry.name] > RESTART_MAX_S:
                    delays[entry.name] = RESTART_FIRST_S
                logger.warning(_failure(entry, daemon, f"exited with status {daemon.process.returncode}")
                    + f"\nstarting it again in {delays[entry.name]:g} s")
                if self.stopping.wait(delays[entry.name]):
                    return
                self._spawn(entry)
                started[entry.name] = time.monotonic()
                delays[entry.name] = min(2 * delays[entry.name], RESTART_MAX_S)


def _setting(command: click.Context, values: dict, name: str):
    """A parameter of the workload as it will run: given on the command line, else the file's, else its default."""
    if command.get_parameter_source(name) is ParameterSource.COMMANDLINE:
        return command.params[name]
    return values.get(name, command.params[name])


def _wait_until_listening(entry: ToStart, daemon: LocalDaemon, since_ns: int, deadline: float) -> None:
    while not _listening(daemon.endpoint, since_ns):
        if not daemon.alive():
            raise RigError(_failure(entry, daemon, f"exited while starting (status {daemon.process.returncode})"))
        if time.monotonic() > deadline:
            raise RigError(_failure(entry, daemon, f"did not listen within {START_TIMEOUT_S:.0f} s"))
        time.sleep(POLL_S)


def _listening(endpoint: str, since_ns: int) -> bool:
    """An ipc:// socket file made since `since_ns` (not a stale one), or a tcp:// port that accepts."""
    if endpoint.startswith("ipc://"):
        try:
            return os.stat(endpoint.removeprefix("ipc://")).st_ctime_ns >= since_ns
        except FileNotFoundError:
            return False
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = "127.0.0.1" if host in ("*", "0.0.0.0") else host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=POLL_S).close()
        return True
    except OSError:
        return False


def _failure(entry: ToStart, daemon: LocalDaemon, what: str) -> str:
    tail = daemon.stderr_tail()
    return (f"daemon {entry.name} ({entry.device} on {daemon.endpoint}) {what}"
            + (f"; the end of its stderr:\n{tail}" if tail else "; it wrote nothing to stderr"))
