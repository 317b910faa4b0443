"""The decision model and everything that runs it: base loading, the template, packed batches, our
Qwen3.5 decoder, LoRA adapters, checkpoints, the image-feature cache, CUDA graphs and `Predictor`."""
