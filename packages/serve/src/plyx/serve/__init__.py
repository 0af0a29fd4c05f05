"""Generation API, continuous-batching engine and OpenAI-compatible server for plyx."""

__all__: list[str] = []
