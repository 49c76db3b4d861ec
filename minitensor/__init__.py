"""minitensor: layers with hand-derived forward and backward passes over NumPy or CuPy arrays.

Importing it changes nothing in the process: no environment variable, no allocator setting, no
thread (a Jupyter kernel or a server that imports it keeps its own). The choices a training
process wants are made by the entry points (`python -m andrea.train`, `andrea.bench`,
`andrea.sample`; see andrea/__init__.py): OpenBLAS's thread timeout and glibc's malloc thresholds
(minitensor.memory.keep_freed_memory), each left alone when the user set it.
"""
