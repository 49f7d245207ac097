"""pdserve gateway service."""
