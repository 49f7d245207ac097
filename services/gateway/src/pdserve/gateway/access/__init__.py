"""Who may send a request and how many: API keys (their store and check) and the admission
limits (requests in flight, requests per minute)."""
