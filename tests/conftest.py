"""Shared fixtures: the real default model, pulled once into the normal model cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Hugging Face folder of SmolLM2-135M-Instruct (pulled on first use, instant afterwards)."""
    from ops.pull import pull_model

    return pull_model("smollm2-135m", progress=False)
