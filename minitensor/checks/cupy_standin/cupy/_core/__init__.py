"""The stand-in's private CuPy modules that minitensor.device.set_tf32 uses."""
