"""AdamW for an ANDREA model: minitensor's flat-buffer AdamW, given the model instead of its Params."""

from minitensor.optim import AdamW as _FlatAdamW


class AdamW(_FlatAdamW):
    """AdamW(model, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1); decay on 2+-D tensors only."""

    def __init__(self, model, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        super().__init__(model.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
