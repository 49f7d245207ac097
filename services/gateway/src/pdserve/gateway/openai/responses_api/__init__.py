"""The OpenAI Responses API (``POST /v1/responses``) on the chat path.

`schemas` holds the request body, `convert` turns it into chat `GenerationParams` (input items
as messages, ``instructions`` as the system message, ``text.format`` as a `Constraint`), and
`writer` shapes the output as a ``Response`` object or its stream of typed events. A response
is stateless unless it runs in the ``background``: `background` stores it, serves it again on
any gateway and cancels it.
"""
