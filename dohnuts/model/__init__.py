"""The network: base loading, our Qwen3.5 decoder, the vision tower, the decision model, LoRA
adapters and the frozen image-feature cache."""
