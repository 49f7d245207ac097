"""Edge code shared by the prefill and decode servers: loading a model for serving and
converting between pdserve.v1 messages and the engine's plain types."""
