"""Tool calling (OpenAI's function calling): the tools a request offers and the calls in its
history (`spec`), how they reach the chat template (`prompt`, `formats`), the constraint that
forces a call (`constraint`), and the calls read back from the model's output (`parsers`,
`output`)."""
