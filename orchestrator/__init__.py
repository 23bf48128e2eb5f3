"""cellgate's gateway: config, conversations, sessions, harnesses, the HTTP API, the CLI."""
