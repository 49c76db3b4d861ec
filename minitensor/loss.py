"""Softmax cross-entropy, fused: loss = mean over all N positions of logsumexp(z) - z[target].

Shapes: logits (..., V), targets (...) integer ids in [0, V). backward(dloss=1) returns
dlogits = dloss * (softmax(z) - onehot(target)) / N. The log-sum-exp subtracts the row maximum
first, so large logits cannot overflow. The forward caches the probabilities (one array of the
size of the logits) and, with `inplace=True`, writes them over the logits to save that memory.
"""

from minitensor.backend import array_module
from minitensor.embedding import check_ids
from minitensor.layer import Layer


class SoftmaxCrossEntropy(Layer):
    def forward(self, logits, targets, inplace=False):
        xp = array_module(logits)
        V = logits.shape[-1]
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"targets of shape {targets.shape} do not match logits of shape {logits.shape}")
        check_ids(targets, V, what="target id")
        z = logits.reshape(-1, V)                            # (N, V)
        t = targets.reshape(-1)                              # (N,)
        N = z.shape[0]
        rows = xp.arange(N)
        zmax = z.max(axis=1, keepdims=True)
        probs = z if inplace else z.copy()
        probs -= zmax
        picked = probs[rows, t].copy()                       # z[target] - max
        xp.exp(probs, out=probs)
        sumexp = probs.sum(axis=1, keepdims=True)
        probs /= sumexp
        loss = (xp.log(sumexp[:, 0]) - picked).mean()
        self._save(probs, t, logits.shape)
        return loss

    def backward(self, dloss=1.0):
        probs, t, shape = self._pop()
        xp = array_module(probs)
        N = probs.shape[0]
        # forward was: loss = mean_n(logsumexp(z_n) - z_n[t_n]); d/dz_n = (softmax(z_n) - onehot(t_n)) / N
        dz = probs
        dz[xp.arange(N), t] -= 1.0
        dz *= dloss / N
        return dz.reshape(shape)
