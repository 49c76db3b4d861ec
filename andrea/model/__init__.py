"""The model: ANDREA itself and what trains its weights.

    transformer.py   ANDREA (GPT-2's architecture from minitensor layers), its Block and MLP
                     composites (which own the fusion schedule), parameter counts, FLOPs per token
    optim.py         AdamW given the model: minitensor's flat-buffer AdamW over its Params
"""
