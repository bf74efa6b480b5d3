"""`moerun systemd --config FILE -o DIR`: systemd units that run a rig config (docs/systemd.md).

One template, `moerun-daemon@.service`, runs every daemon and layer shard: instance NAME reads
its model, device, endpoint, CURVE key flags, CPU flags and (a shard) its layers and context
from `moerun-daemon-NAME.env`. `moerun.service`
runs the parent's workload against those endpoints. All units share /run/moerun and /dev/shm, so
the shared memory transport works between them. A CPU daemon on this host runs the threads
`moerun launch` would give it (this host's CPUs split between the parent and its CPU daemons,
rig/cores.py; the parent splits them the same way when it starts), on its NUMA node if it has
one, and with `pin` on its own CPUs (a CPUAffinity drop-in).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from moerun.commands.launch import WORKLOAD_COMMANDS
from moerun.commands.options import friendly_errors
from moerun.config import load_config_file
from moerun.engine.runtime import DEFAULT_CONTEXT
from moerun.gguf.reader import GGUFFile
from moerun.models import load_spec
from moerun.rig.cores import HostShares, format_cpus, share_host
from moerun.rig.settings import DaemonEntry, ProcessEntry, RigConfig, SplitEntry, shard_flags
from moerun.rig.spawn import BLAS_THREAD_VARIABLES, pinned_device

DAEMON_TEMPLATE = "moerun-daemon@.service"
PARENT_UNIT = "moerun.service"
GPU_GROUPS_DROP_IN = "gpu-groups.conf"
CPUS_DROP_IN = "cpus.conf"
SHARED_SERVICE_SETTINGS = """\
Restart=on-failure
RestartSec=5
# The parent and its daemons share sockets in /run/moerun and segments in /dev/shm.
RuntimeDirectory=moerun
RuntimeDirectoryPreserve=yes
PrivateTmp=no
RemoveIPC=no
# Pinned host memory for GPU transfers.
LimitMEMLOCK=infinity
"""
AMD_GPU_GROUPS = "SupplementaryGroups=render video\n"
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]*[$]?$")


@click.command()
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help="Rig config file (TOML, docs/config.md); every [[daemon]] needs a device and an endpoint.")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Directory to write the units and environment files to.")
@click.option("--env-dir", default="/etc/moerun", show_default=True,
              help="Where the environment files will be installed; the units read them there.")
@click.option("--user", default=None, help="Run the units as this user [default: root].")
@friendly_errors
def systemd(config_file, out_dir, env_dir, user):
    """Write systemd units for the daemons and the parent of a rig config."""
    if not env_dir.startswith("/"):
        raise click.BadParameter(f"{env_dir!r}: systemd needs an absolute path", param_hint="--env-dir")
    if user is not None and not USER_NAME.match(user):
        raise click.BadParameter(f"{user!r} is not a user name", param_hint="--user")
    values = load_config_file(config_file, unit_rules)
    files = render_units(Path(config_file).resolve(), values, env_dir, user)
    for name, text in files.items():
        path = Path(out_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    click.echo("\n".join(str(Path(out_dir) / name) for name in files))
    click.echo(f"install them as docs/systemd.md shows: units in /etc/systemd/system, *.env in {env_dir}", err=True)


def unit_rules(values: dict, reader) -> None:
    """What units cannot run, reported with the config reader's own problems (load_config_file
    rules): no model, a daemon or shard without a device or an endpoint, CURVE key paths with
    whitespace, two units of one name."""
    if "model" not in values and not reader.failed(("model",)):
        reader.problem((), "systemd units need `model`")
    for table in ("daemon", "split"):
        for index, entry in enumerate(values.get(f"{table}_entries", ())):
            where = (table, index)
            if any(getattr(entry, key) is None and not reader.failed(where + (key,)) for key in ("device", "endpoint")):
                reader.problem(where, f"[[{table}]] {entry.name} needs a device and an endpoint to run as a unit "
                                      f"(e.g. endpoint = \"ipc:///run/moerun/{entry.name}.sock\")", numbered=False)
    for table in ("daemon", "split"):
        for index, entry in enumerate(values.get(f"{table}_entries", ())):
            keys = (entry.curve_secret_key, entry.curve_authorized_keys)
            # the unit splits $MOERUN_CURVE_FLAGS at whitespace, so no path may hold any
            if all(keys) and any(re.search(r"\s", key) for key in keys):
                reader.problem((table, index), f"[[{table}]] {entry.name}: CURVE key paths in a unit cannot contain "
                                               f"whitespace", numbered=False)
    taken = {entry.name for entry in values.get("daemon_entries", ())}
    for index, entry in enumerate(values.get("split_entries", ())):
        if entry.name in taken:
            reader.problem(("split", index), f"[[split]] {entry.name}: another daemon or shard has that name, and "
                                             f"each runs as moerun-daemon@NAME: name them apart", numbered=False)
        taken.add(entry.name)


def render_units(config_path: Path, values: dict, env_dir: str, user: str | None) -> dict[str, str]:
    """{file name: contents} of the daemon template, one environment file per daemon (with a
    drop-in for AMD GPU daemons), and the parent's unit, from values that passed unit_rules."""
    entries: tuple[DaemonEntry, ...] = values.get("daemon_entries", ())
    user_line = f"User={user}\n" if user else ""
    cpus = share_host(RigConfig(daemons=tuple(entry.spec for entry in entries), daemon_entries=entries,
                                device=values.get("device", "cpu"), threads=values.get("threads"),
                                pin=values.get("pin", False)))
    files = {DAEMON_TEMPLATE: _daemon_template(env_dir, user_line)}
    for index, entry in enumerate(entries):
        threads = cpus.daemons[index].threads if index in cpus.daemons else entry.threads
        files[f"moerun-daemon-{entry.name}.env"] = _daemon_environment(config_path, values["model"], entry, threads)
        if entry.device.startswith("hip"):
            files[f"moerun-daemon@{entry.name}.service.d/{GPU_GROUPS_DROP_IN}"] = f"[Service]\n{AMD_GPU_GROUPS}"
        if cpus.pin and index in cpus.daemons:
            files[f"moerun-daemon@{entry.name}.service.d/{CPUS_DROP_IN}"] = _cpu_affinity(cpus, index)
    splits: tuple[SplitEntry, ...] = values.get("split_entries", ())
    for entry, flags in zip(splits, _shard_flags(values, splits)):
        files[f"moerun-daemon-{entry.name}.env"] = _shard_environment(config_path, values["model"], entry, flags)
        if entry.device.startswith("hip"):
            files[f"moerun-daemon@{entry.name}.service.d/{GPU_GROUPS_DROP_IN}"] = f"[Service]\n{AMD_GPU_GROUPS}"
    files[PARENT_UNIT] = _parent_unit(config_path, values, (*entries, *splits), user_line)
    return files


def _shard_flags(values: dict, splits: tuple[SplitEntry, ...]) -> list[tuple[str, ...]]:
    """Each shard's --layers (from its layer to the next table's, the last to the model's end)
    and --ctx (the run's --kv-pool or --ctx, else the model's default context)."""
    if not splits:
        return []
    with GGUFFile(values["model"]) as gguf:
        spec = load_spec(gguf)
    ctx = values.get("kv_pool") or values.get("ctx") or min(spec.context_train, DEFAULT_CONTEXT)
    ends = [*(entry.layer for entry in splits[1:]), spec.n_layers]
    return [(*shard_flags(range(entry.layer, end), ctx), *entry.expert_flags) for entry, end in zip(splits, ends)]


def _shard_environment(config_path: Path, model: str, entry: SplitEntry, flags: tuple[str, ...]) -> str:
    device, pinning = pinned_device(entry.device, environment={})
    variables = {"MOERUN_MODEL": model, "MOERUN_DEVICE": device, "MOERUN_LISTEN": entry.listen or entry.endpoint,
                 **pinning, "MOERUN_SHARD_FLAGS": " ".join(flags)}
    if entry.curve_flags:
        variables["MOERUN_CURVE_FLAGS"] = " ".join(entry.curve_flags)
    where = f" on {entry.host}" if entry.host else ""
    lines = [f"# moerun layer shard {entry.name} ({entry.device}{where}, {' '.join(flags)}) of {config_path}"]
    lines += [f'{name}="{_env_quote(value)}"' for name, value in variables.items()]
    return "\n".join(lines) + "\n"


def _daemon_template(env_dir: str, user_line: str) -> str:
    command = (f"{_moerun()} daemon --model ${{MOERUN_MODEL}} --device ${{MOERUN_DEVICE}} --listen ${{MOERUN_LISTEN}} "
               "$MOERUN_CURVE_FLAGS $MOERUN_CPU_FLAGS $MOERUN_SHARD_FLAGS")
    return f"""\
[Unit]
Description=moerun daemon %i
After=network.target

[Service]
Type=exec
EnvironmentFile={_specifiers(env_dir)}/moerun-daemon-%i.env
ExecStart={command}
{SHARED_SERVICE_SETTINGS}{user_line}
[Install]
WantedBy=multi-user.target
"""


def _daemon_environment(config_path: Path, model: str, entry: DaemonEntry, threads: int | None) -> str:
    """The daemon's variables; a CPU daemon's thread count (its BLAS's too) where one is known:
    its share of this host, or the count its entry gives for another host."""
    device, pinning = pinned_device(entry.device, environment={})   # units never inherit this shell's pinning
    variables = {"MOERUN_MODEL": model, "MOERUN_DEVICE": device, "MOERUN_LISTEN": entry.listen or entry.endpoint,
                 **pinning}
    if entry.curve_flags:     # split at whitespace where the unit uses it (unit_rules)
        variables["MOERUN_CURVE_FLAGS"] = " ".join(entry.curve_flags)
    if device == "cpu":
        thread_flags = () if threads is None else ("--threads", str(threads))
        if thread_flags or entry.node_flags:
            variables["MOERUN_CPU_FLAGS"] = " ".join((*thread_flags, *entry.node_flags))
        variables.update({name: str(threads) for name in BLAS_THREAD_VARIABLES if threads is not None})
    where = f" on {entry.host}" if entry.host else ""
    lines = [f"# moerun daemon {entry.name} ({entry.device}{where}) of {config_path}"]
    lines += [f'{name}="{_env_quote(value)}"' for name, value in variables.items()]
    return "\n".join(lines) + "\n"


def _cpu_affinity(cpus: HostShares, index: int) -> str:
    share = cpus.daemons[index]
    return f"# {cpus.describe()}\n[Service]\nCPUAffinity={format_cpus(share.cpus)}\n"


def _parent_unit(config_path: Path, values: dict, entries: tuple[ProcessEntry, ...], user_line: str) -> str:
    workload = values.get("workload", "generate")
    local = " ".join(f"moerun-daemon@{entry.name}.service" for entry in entries if entry.runs_here())
    remote = any(not entry.runs_here() for entry in entries)
    ordering = "".join(f"{setting}={local}\n" for setting in ("Wants", "After") if local)
    ordering += "Wants=network-online.target\nAfter=network-online.target\n" if remote else ""
    groups = AMD_GPU_GROUPS if values.get("device", "cpu").startswith("hip") else ""
    return f"""\
[Unit]
Description=moerun {workload}: {_specifiers(Path(values["model"]).name)}
{ordering}
[Service]
Type=exec
ExecStart={_moerun()} {WORKLOAD_COMMANDS[workload]} --config {_exec_quote(str(config_path))}
# SIGTERM ends the parent through its shutdown path, with status 143.
SuccessExitStatus=143
{SHARED_SERVICE_SETTINGS}{groups}{user_line}
[Install]
WantedBy=multi-user.target
"""


def _moerun() -> str:
    """This Python running moerun, so the units use the installation that wrote them."""
    return f"{_exec_quote(sys.executable)} -m moerun"


def _exec_quote(arg: str) -> str:
    """One ExecStart argument: specifiers and variables escaped, quoted if it needs it."""
    arg = _specifiers(arg).replace("$", "$$")
    return arg if re.fullmatch(r"[\w/.:@+=,%$-]+", arg) else '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _specifiers(text: str) -> str:
    return text.replace("%", "%%")


def _env_quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')
