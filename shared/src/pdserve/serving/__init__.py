"""Code shared by the servers: the prefill and decode instance scaffold (server, status, CLI),
loading a model for serving, and converting between pdserve.v1 messages and the shared plain
types (every service)."""
