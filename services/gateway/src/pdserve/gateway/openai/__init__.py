"""The REST edge: the OpenAI-compatible API (HTTP plumbing, body schemas and parsing,
responses and SSE) and the uvicorn server that serves it."""
