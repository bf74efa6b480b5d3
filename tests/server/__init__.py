"""The OpenAI-compatible server: request parsing, the worker, a live server."""
