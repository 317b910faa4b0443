"""Dohnuts: small multimodal decision models answering typed questions in one forward pass.

`dohnuts.Predictor` is imported lazily, so `import dohnuts.<module>` stays light.
"""

__all__ = ["Predictor"]


def __getattr__(name):
    if name == "Predictor":
        from .runtime.predict import Predictor

        return Predictor
    raise AttributeError(f"module 'dohnuts' has no attribute {name!r}")
