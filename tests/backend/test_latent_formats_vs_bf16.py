"""FP8 latent KV pages against BF16 pages, on both MLA families (a tiny random DeepseekV3 and a tiny
random GlmMoeDsa with top-8 key selection): the mean KL divergence of next-token distributions,
KL(p_bf16 || p_fp8), over every position of a few random prompts scored through chunked prefill
over the pages (chunks of 16, so each later chunk reads the earlier keys back from pages of that
format). KL(p_fp32 || p_bf16) on the same prompts is printed beside it as the floor. Figures in
the test output with -s.

For GlmMoeDsa both engines keep the serving FP8 indexer keys: the indexer reads the hidden
states, which the latent format changes slightly from the second layer on, so a key whose score
nearly ties may be selected on one side and not the other. That is part of what the latent
format costs on this family and is included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.backend.test_deepseek_v3 import _all_logprobs, _engine
from tests.backend.tiny_mla_models import write_tiny_deepseek_v3

PROMPT_LENGTHS = (24, 40, 64, 96)  # as tests/backend/test_deepseek_v3.py


def logprobs(model_dir: Path, kv_format: str) -> torch.Tensor:
    """Next-token log-distributions at every position of the prompts (concatenated), pages in `kv_format`."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    engine = _engine(model_dir, kv_format=kv_format, prefill_chunk_size=16)
    return torch.cat([_all_logprobs(engine, ids) for ids in prompts])


def mean_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), both log-probabilities [positions, vocab]."""
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.backend.test_glm_moe_dsa import write_tiny_glm_moe_dsa

    root = tmp_path_factory.mktemp("latent-formats")
    return {"deepseek_v3": write_tiny_deepseek_v3(root / "dsv3", seed=1),
            "glm_moe_dsa": write_tiny_glm_moe_dsa(root / "glm5", seed=1)}


@pytest.mark.parametrize("model", ["deepseek_v3", "glm_moe_dsa"])
def test_fp8_latent_pages_stay_close_to_bf16(model_dirs: dict[str, Path], model: str) -> None:
    fp32, bf16, fp8 = (logprobs(model_dirs[model], f) for f in ("fp32", "bf16", "fp8_e4m3"))
    floor, kl = mean_kl(fp32, bf16), mean_kl(bf16, fp8)
    print(f"{model}: mean KL(bf16 || fp8_e4m3) = {kl:.3e}; KL(fp32 || bf16) = {floor:.3e}")
    assert 0 < floor < 1e-4
    assert floor < kl < 5e-3  # FP8 costs more than BF16 rounding, and stays small
