"""minitensor: layers with hand-derived forward and backward passes over NumPy or CuPy arrays."""
