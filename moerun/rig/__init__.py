"""The rig: everything that decides where a routed expert's work runs and moves it there —
the daemons' settings, spawning, supervision and reconnection, the transport choice, the CPU
and GPU dispatchers (the forward pass's executor when daemons are in play), the GPU channels
and IPC buffers, and, on the daemon's side, its request handling and compute."""
