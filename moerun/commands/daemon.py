"""`moerun daemon`: serve experts of a model to one parent at a time (moerun.daemons)."""
from __future__ import annotations

import click

from moerun.commands.options import MODEL_HELP, friendly_errors, model_or_demo
from moerun.ipc.sockets import ENDPOINT


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or hip:N.")
@click.option("--listen", required=True, metavar="ENDPOINT", help="ipc://PATH or tcp://HOST:PORT.")
@click.option("--curve-secret-key", type=click.Path(dir_okay=False), default=None,
              help="This daemon's CURVE secret key file (`moerun keys`); needed on a tcp:// address "
                   "other hosts can reach.")
@click.option("--curve-authorized-keys", type=click.Path(), default=None, metavar="FILE|DIR",
              help="Public key file, or directory of them, of the parents it serves.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the experts [default: $OMP_NUM_THREADS, else every CPU it may run on].")
@click.option("--numa-node", type=click.IntRange(min=0), default=None, metavar="N",
              help="Run on NUMA node N's CPUs only (Linux).")
@click.option("--parent-pid", type=int, default=None, hidden=True)
@friendly_errors
def daemon(model, device, listen, curve_secret_key, curve_authorized_keys, threads, numa_node, parent_pid):
    """Serve experts of MODEL to one parent at a time; starts with none, the parent assigns them."""
    from moerun.daemons.daemon import serve
    if not ENDPOINT.match(listen):
        raise click.BadParameter(f"expected ipc://PATH or tcp://HOST:PORT, got {listen!r}", param_hint="--listen")
    serve(model_or_demo(model), device, listen, parent_pid, curve_secret_key, curve_authorized_keys, threads,
          numa_node)
