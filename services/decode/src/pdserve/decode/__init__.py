"""pdserve decode service."""
