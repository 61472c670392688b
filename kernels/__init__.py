"""Triton kernels, each with a launcher and a plain-torch reference (later issues)."""
