"""minitensor: layers with hand-derived forward and backward passes over NumPy or CuPy arrays.

    layers/     the layers, each file opening with its maths (Linear, LayerNorm, GELU, attention, ...)
    backends/   the arithmetic: ops.py (Ops, the reference every backend is checked against),
                numpy_ops.py + cpu/ (the CPU), cupy_ops.py + cuda.py + kernels/ (the GPU)
    checks/     gradient checks, the GPU kernels' self-check, compile and emulation checks
    device.py   which device a model runs on (NumPy or CuPy), and moving arrays between them
    flat.py     every parameter in one flat buffer, every gradient in another of the same layout
    optim.py    AdamW over those buffers
    parallel.py, memory.py   the CPU's threads and the process's allocator settings

Importing it changes nothing in the process: no environment variable, no allocator setting, no
thread (a Jupyter kernel or a server that imports it keeps its own). The choices a training
process wants are made by the entry points (`python -m andrea.train`, `andrea.bench`,
`andrea.sample`; see andrea/__init__.py): OpenBLAS's thread timeout and glibc's malloc thresholds
(minitensor.memory.keep_freed_memory), each left alone when the user set it.
"""
