"""Chat output parsing shared by the server and the offline `LLM.chat`: reasoning sections (`reasoning.py`) and
tool calls (`tool_parsers.py`) in generated text."""
