"""The tables a GPU parent's MoE layers route by, on the device and mirrored on the host: each
global expert id -> the parent's local id (its hot experts, then the expert cache's slots;
-1: elsewhere), -> each daemon's local id (-1: not sent there), -> the host index of the
experts a streamed prefill chunk computes from the copied layer (-1: not streamed), and -> the
host index of the host-RAM experts the GPU reads in place in the other steps (-1: not). The kernels
read them inside captured steps; the expert cache moves an expert between its daemon and a
cache slot by rewriting them between steps, in stream order.
Shape legend: E experts.
"""
from __future__ import annotations

import numpy as np

from moerun.moe.placement import PARENT, Placement
from moerun.rig.gpu.host_experts import HostExperts


class RoutingTables:
    def __init__(self, backend, placement: Placement, daemons: list[int], host: HostExperts | None,
                 read_in_place: dict[int, np.ndarray] | None = None):
        """read_in_place: per layer, the global ids of the host experts the GPU reads in place."""
        self.backend = backend
        self.homes = placement.homes
        self._home_local = {layer: np.zeros(len(homes), np.int32) for layer, homes in self.homes.items()}
        self.parent = {layer: placement.local_ids(layer, PARENT) for layer in self.homes}           # [E]
        self.daemon = {(index, layer): placement.local_ids(layer, index) for index in daemons for layer in self.homes}
        for (index, layer), local in self.daemon.items():
            self._home_local[layer] = np.where(local >= 0, local, self._home_local[layer])
        host_layers = host.layers if host is not None else {}
        self.host_index = {layer: host_layer.index for layer, host_layer in host_layers.items()}    # [E], fixed
        self.streamed = {layer: index.copy() for layer, index in self.host_index.items()}           # [E]
        self.reads = {layer: np.full(len(index), -1, np.int32) for layer, index in self.host_index.items()}  # [E]
        self._read_here = {layer: np.zeros(len(index), bool) for layer, index in self.host_index.items()}
        for layer, experts in (read_in_place or {}).items():
            self._read_here[layer][experts] = True
            self.reads[layer][experts] = self.host_index[layer][experts]
            for (index, at), local in self.daemon.items():
                if at == layer:
                    local[experts] = -1
        self._host, self._device, self.on_device = self._gathered(backend.device.cupy)
        self._staged: list[np.ndarray] = []         # page-locked copies of the tables being uploaded
        self._uploaded = None                       # event: the last upload is done

    def _gathered(self, cupy):
        """The changing tables as rows of one matrix [R, E], here and on the device (one upload
        moves them all), each mirror and device table a view of its row; the fixed host_index
        tables beside them."""
        rows = [(name, key) for name, tables in self._mirrors().items() for key in tables]
        tables = [self._mirrors()[name][key] for name, key in rows]
        host = np.stack(tables).astype(np.int32) if tables else np.zeros((0, 1), np.int32)      # [R, E]
        device = cupy.asarray(host)
        on_device = {name: {} for name in self._mirrors()}
        for row, (name, key) in enumerate(rows):
            self._mirrors()[name][key] = host[row]
            on_device[name][key] = device[row]
        on_device["host_index"] = {layer: cupy.asarray(index) for layer, index in self.host_index.items()}
        return host, device, on_device

    def _mirrors(self) -> dict[str, dict]:
        """The tables that change, by name."""
        return {"parent": self.parent, "daemon": self.daemon, "streamed": self.streamed, "reads": self.reads}

    def hold(self, layer: int, expert: int, local: int) -> None:
        """`expert` (homed on a daemon) is computed by the parent at its local id `local` from now."""
        self.parent[layer][expert] = local
        self.daemon[(int(self.homes[layer][expert]), layer)][expert] = -1
        self.streamed[layer][expert] = -1
        self.reads[layer][expert] = -1

    def release(self, layer: int, expert: int) -> None:
        """`expert` goes back to where it was computed before the parent held it: its daemon, or
        the GPU's reads in place (and to the streamed chunks) from now."""
        self.parent[layer][expert] = -1
        if self._read_here[layer][expert]:
            self.reads[layer][expert] = self.host_index[layer][expert]
        else:
            self.daemon[(int(self.homes[layer][expert]), layer)][expert] = self._home_local[layer][expert]
        self.streamed[layer][expert] = self.host_index[layer][expert]

    def upload(self) -> None:
        """Every table to the device in one copy, after the work already queued on the backend's
        stream, from a page-locked copy (a copy from pageable memory would wait for the stream first)."""
        stream = self.backend.device.stream
        if self._uploaded is not None and self._uploaded.done:
            self._staged.clear()
        staged = self.backend.device.pinned(self._host.shape, self._host.dtype)
        staged[:] = self._host
        self._device.set(staged, stream=stream)
        self._staged.append(staged)
        self._uploaded = stream.record()
