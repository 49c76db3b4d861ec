"""The stand-in's cupy_backends package: the CUDA library modules CuPy keeps outside cupy."""
