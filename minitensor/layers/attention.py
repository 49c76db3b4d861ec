"""Causal multi-head self-attention with a fused qkv projection (GPT-2's layout).

    qkv = x @ W_attn + b_attn                 # (B, T, 3C): q, k, v are consecutive C-wide slices
    head h uses columns h*hs:(h+1)*hs of each, hs = C / n_head
    att = softmax(q k^T / sqrt(hs) + mask)    # (B, nh, T, T), mask = -inf above the diagonal
    y = att v                                 # (B, nh, T, hs), heads concatenated back in order
    out = y @ W_proj + b_proj                 # (B, T, C)

and backward, the core's terms named as the forward lines they differentiate:

    dv = att^T dy                             # y = att v
    datt = dy v^T
    ds = att * (datt - rowsum(datt * att))    # att = softmax(s) by rows; rowsum(datt att) = rowsum(dy y)
    dq = ds k / sqrt(hs),  dk = ds^T q / sqrt(hs)   # s = q k^T / sqrt(hs)

The core is `ops.attention_forward` / `attention_backward`: in Ops (minitensor.backends.ops) these
lines as written, dense; the CPU and the GPU past a memory budget run it over blocks of query rows
that never compute the scores above the diagonal (minitensor.backends.blocked). b_attn goes into
the core with c_attn's output (a backend adds it in the copies that make each head contiguous, or, the
flash kernels, as they read q, k and v where c_attn wrote them), and
the block's residual (`forward(x, residual=r)`) into c_proj's epilogue. In backward the core also
sums b_attn's gradient, the column sums of dqkv (`ops.attention_backward_and_bias`: the flash kernels
as they write dqkv, other backends by add_bias_grad after it).
`forward_kv` is the inference path: it appends to a key/value cache so each new token costs one
row of attention instead of re-running the whole sequence.
"""

import math
from typing import NamedTuple

from minitensor.backends.ops import qkv_heads
from minitensor.layers.layer import Layer


class SelfAttentionCache(NamedTuple):
    x: object                  # (B*T, C), c_attn's input
    y: object                  # (B*T, C), c_proj's input: the heads' outputs side by side
    core: object               # what ops.attention_forward returned for ops.attention_backward
    shape: tuple               # (B, T, C)


class CausalSelfAttention(Layer):
    block = 128                      # query rows per block of the core
    # Probabilities up to this many bytes in all are kept from forward to backward; larger ones
    # are recomputed there from q, k and the row log-sum-exp (one more q k^T GEMM per block).
    keep_probs_max_bytes = 16 << 20
    # The dense core (one batched GEMM per product, no blocks): None lets the backend choose (on
    # CuPy within a memory budget); True or False forces it either way.
    dense = None

    def __init__(self, c_attn, c_proj, n_head, ops=None):
        """c_attn: Linear C -> 3C; c_proj: Linear C -> C; n_head must divide C. This layer runs
        their products itself (the bias of c_attn goes into the attention core)."""
        super().__init__(ops)
        C = c_proj.W.shape[0]
        if C % n_head:
            raise ValueError(f"d_model {C} is not divisible by n_head {n_head}")
        self.c_attn, self.c_proj, self.n_head = c_attn, c_proj, n_head

    def forward(self, x, residual=None, epilogue=True):
        """out = c_proj(attention(c_attn(x))) (+ residual, added in c_proj's epilogue, if given); epilogue
        False: c_proj's product without its bias, for the caller to join (Norm.forward_joined)."""
        xp = self._take_ops(x).xp
        B, T, C = x.shape
        x2 = x.reshape(B * T, C)
        qkv = self.ops.matmul(x2, self.c_attn.W)             # (B*T, 3C), its bias added by the core
        y = xp.empty((B, T, C), dtype=x.dtype)               # the heads written back in (B, T, C) order
        cache = self.ops.attention_forward(self._heads(qkv, B, T), self.c_attn.b, self._heads(y, B, T, 1)[0],
                                           self.block, self.keep_probs_max_bytes, self.dense)
        out = self.ops.matmul(y.reshape(B * T, C), self.c_proj.W)
        if epilogue:
            self.ops.add_epilogue(out, self.c_proj.b, None if residual is None else residual.reshape(out.shape))
        self._save(SelfAttentionCache(x2, y.reshape(B * T, C), cache, x.shape))
        return out.reshape(B, T, C)

    def backward(self, dout, sum_bias=True):
        """dx from dout; sum_bias False leaves c_proj's bias gradient to the caller (a pre-norm block's
        norm sums it in the pass that reads dout as its skip: Norm.backward_and_sum_skip)."""
        x2, y2, cache, (B, T, C) = self._pop()
        dout2 = dout.reshape(B * T, C)
        # forward was: out = y @ W_proj + b_proj
        self.c_proj.weight_grads(y2, dout2, bias=sum_bias)
        dy = self.ops.matmul(dout2, self.c_proj.W.T)         # (B*T, C)
        dqkv = self.ops.xp.empty((B * T, 3 * C), dtype=dout.dtype)
        # forward was: qkv = x @ W_attn + b_attn (the bias added by the core): its bias gradient, dqkv's
        # column sums, summed by the core's backward as it writes dqkv
        self.ops.attention_backward_and_bias(self._heads(dy, B, T, 1)[0], cache, dqkv, self.c_attn.db)
        self.c_attn.weight_grads(x2, dqkv, bias=False)
        return self.ops.matmul(dqkv, self.c_attn.W.T).reshape(B, T, C)

    def _heads(self, a, B, T, parts=3):
        """(B*T, parts*C) -> parts (B, nh, T, hs) views."""
        return qkv_heads(a, B, T, self.n_head, parts)

    def forward_kv(self, x, cache, pos, residual=None, record=None):
        """Inference: x (B, T_new, C) at positions pos.., with cache = (k, v) arrays (B, nh, T_max, hs).

        Writes the new keys and values into the cache and attends over positions [0, pos + T_new),
        with the training forward's softmax; keeps nothing for backward. residual as in forward.
        record: a dict that receives the attention probabilities, record["probs"] (B, nh, T_new,
        pos + T_new), zero above the diagonal (andrea.trace).
        """
        self._take_ops(x)
        B, T, C = x.shape
        hs = C // self.n_head
        qkv = self.ops.matmul(x.reshape(B * T, C), self.c_attn.W)
        self.ops.add_epilogue(qkv, self.c_attn.b)
        q, k, v = self._heads(qkv, B, T)
        k_cache, v_cache = cache
        k_cache[:, :, pos:pos + T] = k
        v_cache[:, :, pos:pos + T] = v
        end = pos + T
        att = self.ops.matmul(q * (1.0 / math.sqrt(hs)), k_cache[:, :, :end].transpose(0, 1, 3, 2))  # (B, nh, T, end)
        # new row i sits at position pos + i: the last T of the end positions, as causal_softmax takes them
        att = self.ops.causal_softmax(att)
        if record is not None:
            record["probs"] = att
        y = self.ops.matmul(att, v_cache[:, :, :end]).transpose(0, 2, 1, 3).reshape(B * T, C)
        out = self.ops.matmul(y, self.c_proj.W)
        self.ops.add_epilogue(out, self.c_proj.b, None if residual is None else residual.reshape(out.shape))
        return out.reshape(B, T, C)
