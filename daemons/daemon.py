"""The daemon process: `moerun daemon --model M --device D --listen ENDPOINT` serves the
experts a parent assigns it (moerun.daemons.handler), or with `--layers A:B` runs those
layers as a layer shard (moerun.daemons.shard), behind moerun.ipc.server, until SHUTDOWN,
SIGTERM/SIGINT, or the death of the parent that spawned it (whose run directory it then
removes, the parent being unable to)."""
from __future__ import annotations

import logging
import signal
import threading
import time

from moerun import log
from moerun.backends.kv_types import KVTypes
from moerun.daemons.handler import ExpertDaemon
from moerun.daemons.shard import LayerShard
from moerun.ipc.curve import server_keys_for
from moerun.ipc.processes import pid_alive
from moerun.ipc.server import Server
from moerun.rig.cores import format_cpus, restrict_to_node
from moerun.rig.settings import RigConfig
from moerun.rig.spawn import remove_orphaned_run_dir

logger = logging.getLogger(__name__)


def serve(model_path: str, device: str, listen: str, parent_pid: int | None,
          curve_secret_key: str | None = None, curve_authorized_keys: str | None = None,
          threads: int | None = None, numa_node: int | None = None, layers: range | None = None,
          ctx: int = 4096, kv_types: KVTypes | None = None, experts: RigConfig | None = None,
          graphs: bool = True) -> None:
    """Run a daemon until SHUTDOWN, SIGTERM/SIGINT, or the death of `parent_pid`. On a tcp://
    address other hosts can reach it needs its CURVE secret key file and the public key file
    (or directory of them) of the parents it serves; elsewhere they are optional. A CPU daemon
    computes with `threads` threads (default_threads() if None), on NUMA node `numa_node`'s
    CPUs only when given (held there before anything is loaded). With `layers` it is a layer
    shard, its KV cache sized for `ctx` positions of `kv_types` (None: the device's), its cold experts on
    the expert daemons `experts` names, if any. On a GPU, one-token work (a shard's steps, an
    expert daemon's requests) is captured as CUDA graphs unless `graphs` is False."""
    log.use_daemon_format()
    curve = server_keys_for(listen, curve_secret_key, curve_authorized_keys)
    if numa_node is not None:
        cpus = restrict_to_node(numa_node)
        logger.info(f"on NUMA node {numa_node}: CPUs {format_cpus(cpus)}")
    daemon = (ExpertDaemon(model_path, device, threads, graphs) if layers is None
              else LayerShard(model_path, device, layers, ctx, threads, kv_types, experts, graphs))
    try:
        with Server(listen, daemon, curve=curve) as server:
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: server.stop())
            if parent_pid is not None:
                threading.Thread(target=_stop_when_gone, args=(parent_pid, server), daemon=True).start()
            server.serve_forever()
    finally:
        daemon.close()
        if parent_pid is not None:
            remove_orphaned_run_dir(listen, parent_pid)


def _stop_when_gone(pid: int, server: Server) -> None:
    """A spawned daemon never outlives its parent (backs up PR_SET_PDEATHSIG)."""
    while pid_alive(pid):
        time.sleep(0.5)
    server.stop()
