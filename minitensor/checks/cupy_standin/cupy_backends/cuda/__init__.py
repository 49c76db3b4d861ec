"""The stand-in's cupy_backends.cuda: a package for its CUDA libraries."""
