"""andrea beside the rest of the field.

    hf.py               the Hugging Face GPT-2 format, both ways (export, --init-from, tokenizers)
    torch_reference.py  the same model in PyTorch, for gradient parity and the benchmark
    components.py       each non-GEMM component timed against PyTorch's own kernel
"""
