"""The OpenAI-compatible HTTP API: protocol models, handlers and the app factory."""
