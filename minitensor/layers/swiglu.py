"""SwiGLU, the gated MLP activation (Shazeer 2020, "GLU Variants Improve Transformer"): the design
document's alternative to GELU at 4x, model.activation=swiglu. Over the last axis, h = [a | b]
splits into a gate a and a value b of F columns each, and

    y  = SiLU(a) * b,      SiLU(a) = a sig(a),   sig(a) = 1 / (1 + exp(-a))          h (..., 2F) -> y (..., F)

Backward, y being a product of SiLU(a) and b:

    db = dy SiLU(a)
    da = dy b SiLU'(a),    SiLU'(a) = sig(a) + a sig(a) (1 - sig(a)) = sig(a) (1 + a (1 - sig(a)))

(sig' = sig (1 - sig)). In an MLP the product before it is twice as wide, x W_fc with W_fc
(C, 2F), and c_proj takes the F columns back to C: at F = 8/3 C its three C x F matrices hold
what GELU's two C x 4C do (8 C^2), so the two compare at the same parameter count.

The formula is `Ops.swiglu_forward` / `swiglu_backward` (minitensor.backends.ops), written once against
xp, so the GPU runs it through the generic Ops (no kernel of its own); an MLP fuses the bias of
the Linear before into its pass through `ops.bias_swiglu_forward` (andrea.model.transformer.MLP).
"""

from typing import NamedTuple

from minitensor.layers.layer import Layer


class SwiGLUCache(NamedTuple):
    h: object


class SwiGLU(Layer):
    def forward(self, h):
        self._take_ops(h)
        y = self.ops.swiglu_forward(h)                       # refuses an odd last axis
        self._save(SwiGLUCache(h))
        return y

    def backward(self, dy):
        (h,) = self._pop()
        return self.ops.swiglu_backward(h, dy)
