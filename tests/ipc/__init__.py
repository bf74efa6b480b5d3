"""The wire: protocol, shared-memory arenas and doorbells, ZeroMQ sessions and deadlines, CURVE, against a fake
daemon."""
