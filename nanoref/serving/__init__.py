"""The online front on an `LLM`: an asyncio engine (`AsyncLLM`) and an OpenAI-compatible HTTP server on it."""
