"""The stand-in's CUDA libraries (cuBLAS), computed on NumPy."""
