"""Entry points to the engine from the outside world: the HTTP server and the CLI."""
