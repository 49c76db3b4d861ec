"""ANDREA: GPT-2-style language models trained with minitensor."""
