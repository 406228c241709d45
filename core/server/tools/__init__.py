"""Tool calling for the chat endpoint.

``parser``: the ``ToolParser`` interface, the parser registry and the result types (imports
nothing heavy: the CLI lists parser names from it). ``hermes``, ``llama3_json``, ``mistral``,
``pythonic``: the built-in parsers. ``request``: validation of ``tools``/``tool_choice``, the conversation history, and
the JSON schema of forced tool use. ``deltas``: the streamed ``tool_calls`` deltas.
"""
