"""Shared pieces every architecture is assembled from (`backend/models/` wires them).

- `loader.py`: checkpoint tensors -> runtime weights, one copy per distinct phase format.
- `norm.py`: RMSNorm (whole rows and per head).
- `attention.py`: GQA attention over the paged KV cache (fused qkv, optional bias,
  per-head q/k norm, full or partial RoPE from `backend/rope.py`).
- `mlp.py`: the dense SwiGLU MLP; `swiglu.py`: its activation, also the MoE experts'.
- `experts.py`: a mixture-of-experts layer read from a checkpoint into `backend.moe.MoEBlock`s.
"""
