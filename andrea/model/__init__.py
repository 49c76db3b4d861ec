"""The model: ANDREA itself, its parts and its sizes.

    transformer.py   ANDREA (GPT-2's architecture from minitensor layers): embeddings, blocks, the
                     tied head and the loss; training, inference with a key/value cache, the trace
    block.py         the Block and MLP composites (which own the fusion schedule) and the variants
    sizes.py         every parameter's shape, the count by part derived from them, FLOPs per token

Its optimizer is minitensor's AdamW (minitensor.optim), given the model: AdamW(model).
"""
