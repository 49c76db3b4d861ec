"""The layers: each file opens with its maths, forward and backward, and computes through `self.ops`.

    layer.py      the contract (forward keeps a cache, backward pops it), the backend it takes, and
                  a norm's promises more (Norm: backward's skip, infer_stats, its params and stats)
    linear.py     y = x W + b
    layernorm.py  y = (x - mean) rstd w + b, by rows
    rmsnorm.py    y = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps), by rows (no mean, no bias)
    gelu.py       GPT-2's tanh GELU          relu.py   max(x, 0)
    swiglu.py     SiLU(a) * b over the two halves [a | b], the gated MLP's activation
    attention.py  causal multi-head self-attention
    embedding.py  token and position embeddings, and the tied output head
    loss.py       softmax cross-entropy

Importing a layer loads no backend: the arithmetic is in minitensor.backends (Ops, the
reference, and the NumPy and CuPy backends that speed it up).
"""

from minitensor.layers.attention import CausalSelfAttention
from minitensor.layers.embedding import Embedding, PositionEmbedding, TiedHead
from minitensor.layers.gelu import GELU
from minitensor.layers.layer import Layer, Norm
from minitensor.layers.layernorm import LayerNorm
from minitensor.layers.linear import Linear
from minitensor.layers.loss import SoftmaxCrossEntropy
from minitensor.layers.relu import ReLU
from minitensor.layers.rmsnorm import RMSNorm
from minitensor.layers.swiglu import SwiGLU

__all__ = ["CausalSelfAttention", "Embedding", "GELU", "Layer", "LayerNorm", "Linear", "Norm", "PositionEmbedding",
           "ReLU", "RMSNorm", "SoftmaxCrossEntropy", "SwiGLU", "TiedHead"]
