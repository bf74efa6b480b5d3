"""A GPU parent's side of the rig: the dispatcher that splits routed pairs on the device
(dispatch.py), its channels to the daemons (channels.py) and the requests rung from inside
captured steps (rings.py); the CPU daemons' experts in page-locked host memory (host_experts.py)
and what reads them: prefill streaming, the expert cache, reads in place, with the tables that
say where each expert is computed. It reaches the backend only through its device interface
(moerun.backends.gpu.device)."""
