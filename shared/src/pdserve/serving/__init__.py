"""Edge code shared by the servers: loading a model for serving (prefill and decode) and
converting between pdserve.v1 messages and the shared plain types (every service)."""
