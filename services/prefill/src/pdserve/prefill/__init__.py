"""pdserve prefill service."""
