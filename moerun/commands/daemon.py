"""`moerun daemon`: serve experts of a model to one parent at a time, or run a range of its layers (moerun.daemons)."""
from __future__ import annotations

import click

from moerun.backends.kv_types import KV_TYPES
from moerun.commands.options import MODEL_HELP, friendly_errors, model_or_demo
from moerun.ipc.sockets import ENDPOINT
from moerun.rig.settings import RigConfig, kv_types_on


class LayerRange(click.ParamType):
    """A:B -> range(A, B)."""
    name = "A:B"

    def convert(self, value, param, ctx):
        if isinstance(value, range):
            return value
        first, _, end = str(value).partition(":")
        if not (first.isdigit() and end.isdigit() and int(first) < int(end)):
            self.fail(f"expected A:B with A < B (layers A..B-1), got {value!r}", param, ctx)
        return range(int(first), int(end))


@click.command()
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None, help=MODEL_HELP)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or hip:N.")
@click.option("--listen", required=True, metavar="ENDPOINT", help="ipc://PATH or tcp://HOST:PORT.")
@click.option("--curve-secret-key", type=click.Path(dir_okay=False), default=None,
              help="This daemon's CURVE secret key file (`moerun keys`); needed on a tcp:// address "
                   "other hosts can reach.")
@click.option("--curve-authorized-keys", type=click.Path(), default=None, metavar="FILE|DIR",
              help="Public key file, or directory of them, of the parents it serves.")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the experts [default: $OMP_NUM_THREADS, else every CPU it may run on].")
@click.option("--numa-node", type=click.IntRange(min=0), default=None, metavar="N",
              help="Run on NUMA node N's CPUs only (Linux).")
@click.option("--layers", type=LayerRange(), default=None, metavar="A:B",
              help="Run layers A..B-1 as a layer shard (a parent's --split DEVICE@A) instead of serving experts.")
@click.option("-c", "--ctx", "--ctx-size", "ctx", type=click.IntRange(min=1), default=4096, show_default=True,
              help="A layer shard's KV cache, in positions (the parent's --ctx).")
@click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(tuple(KV_TYPES)), default=None,
              help="A layer shard's KV cache keys [default: f32 on the CPU, f16 on a GPU].")
@click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(tuple(KV_TYPES)), default=None,
              help="A layer shard's KV cache values [default: as the keys'].")
@click.option("--graph/--no-graph", "graphs", default=True, show_default=True,
              help="On a GPU, a layer shard's one-token steps and an expert daemon's one-token requests run "
                   "as CUDA graphs (--no-graph: eagerly).")
@click.option("--daemon", "expert_daemons", multiple=True, metavar="SPEC",
              help="A layer shard's own expert daemon for its cold experts, as the parent's --daemon. Repeatable.")
@click.option("--hot", type=click.IntRange(min=0), default=None,
              help="With --daemon: experts 0..N-1 of each of the shard's layers stay on it "
                   "[default: experts per token].")
@click.option("--parent-pid", type=int, default=None, hidden=True)
@friendly_errors
def daemon(model, device, listen, curve_secret_key, curve_authorized_keys, threads, numa_node, layers, ctx,
           cache_type_k, cache_type_v, graphs, expert_daemons, hot, parent_pid):
    """Serve experts of MODEL to one parent at a time (it starts with none: the parent assigns
    them), or with --layers run a range of its layers as a layer shard."""
    from moerun.daemons.daemon import serve
    if not ENDPOINT.match(listen):
        raise click.BadParameter(f"expected ipc://PATH or tcp://HOST:PORT, got {listen!r}", param_hint="--listen")
    if (expert_daemons or hot is not None) and layers is None:
        raise click.UsageError("--daemon and --hot are a layer shard's (--layers A:B): an expert daemon has none")
    kv_types = kv_types_on(device, None, cache_type_k, cache_type_v or cache_type_k)
    experts = (RigConfig(daemons=expert_daemons, hot=hot, device=device, threads=threads, cache_type_k=kv_types.key,
                         cache_type_v=kv_types.value) if expert_daemons else None)
    serve(model_or_demo(model), device, listen, parent_pid, curve_secret_key, curve_authorized_keys, threads,
          numa_node, layers, ctx, kv_types, experts, graphs)

