"""TransformerLM (Llama, Qwen2/3, Mistral), checkpoints and Hugging Face interop for plyx."""

__all__: list[str] = []
