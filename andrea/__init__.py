"""ANDREA: GPT-2-architecture language models trained with minitensor, on NumPy or CuPy.

    from andrea import ModelConfig, ANDREA, AdamW
    model = ANDREA(ModelConfig(context_length=128, d_model=128, n_layer=4, n_head=4), device="cpu")
    loss = model.forward(idx, targets); model.zero_grad(); model.backward()
    AdamW(model, lr=3e-3).step()
"""

import minitensor  # noqa: F401  (first: it tunes OpenBLAS's threads before NumPy loads it)
from andrea.config import ModelConfig
from andrea.model import ANDREA
from andrea.optim import AdamW

__all__ = ["ANDREA", "AdamW", "ModelConfig"]
