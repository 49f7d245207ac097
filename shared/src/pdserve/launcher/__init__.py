"""`pdserve up`: runs a whole cluster (gateway, prefills, decodes) as separate processes."""
