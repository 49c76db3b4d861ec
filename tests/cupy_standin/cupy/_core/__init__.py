"""The stand-in's private CuPy modules that minitensor.backend.set_tf32 uses."""
