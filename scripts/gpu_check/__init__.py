"""The GPU check's Python phases (scripts/gpu_check.sh runs them; __main__.py says which part is where)."""
