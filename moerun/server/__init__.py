"""`moerun serve`: an OpenAI-compatible HTTP server over one Runtime (docs/server.md)."""
