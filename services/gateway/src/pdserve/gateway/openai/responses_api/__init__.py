"""The OpenAI Responses API (``POST /v1/responses``), stateless, on the chat path.

`schemas` holds the request body, `convert` turns it into chat `GenerationParams` (input items
as messages, ``instructions`` as the system message, ``text.format`` as a `Constraint`), and
`writer` shapes the output as a ``Response`` object or its stream of typed events.
"""
