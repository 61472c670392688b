"""Names of KV blocks in the cluster's store: a namespace per model and pool format, a key per block.

    key = "edgeserve-kv/<namespace>/<chained block hash hex>"

The namespace is 8 bytes of BLAKE2b over what a block's bytes depend on: the codec
version, the model (`model_fingerprint`: its config.json and the names and sizes of its
weight files, or any id the caller passes), the compute dtype, the prefill weight format
and INT4 group size (the prompt's KV is computed by the prefill weights), and the pool's
block layout (format, page size, layers, each region's bytes per token). Workers whose
blocks could not be copied byte for byte into each other's pools never share a key.
The block hash is `prefix_cache.hashing`'s tenant-salted chained hash: the tenant's salt
and every earlier token are inside it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from backend.errors import InvalidRequest
from backend.kv_store_codec import block_layout

__all__ = ["CODEC_VERSION", "model_fingerprint", "store_namespace", "block_key"]

CODEC_VERSION = "eskv1"


def model_fingerprint(model_dir: Path) -> str:
    """What identifies a model's weights cheaply: its config.json and the names and sizes of its
    weight files (a retrained checkpoint with the same name and shapes still differs in size only
    by chance; pass a version in `model_id` to `store_namespace` where that matters)."""
    h = hashlib.blake2b(digest_size=16)
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.exists() else b"")
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def store_namespace(engine: Any, model_id: str) -> str:
    """The key namespace of `engine`'s blocks (see the module docstring)."""
    cfg = engine.config
    if cfg.tensor_parallel > 1:
        raise InvalidRequest("the KV store tier holds a whole model's KV per block; a tensor-parallel worker's "
                             "pool holds only rank 0's heads (use it with --tensor-parallel 1)")
    lay = block_layout(engine.cache)
    text = "|".join([CODEC_VERSION, model_id, cfg.dtype, str(cfg.prefill_weights), str(cfg.int4_group_size),
                     repr(tuple(lay))])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def block_key(namespace: str, block_hash: bytes) -> str:
    """The store key of one block."""
    return f"edgeserve-kv/{namespace}/{block_hash.hex()}"
