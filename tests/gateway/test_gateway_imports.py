"""The gateway process never loads torch (about 2.5 s and 300 MB at start): it validates grammars
through `backend.grammar_text`, not the decoding side."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_app_imports_without_torch() -> None:
    code = "import sys, gateway.app, gateway.response_format, gateway.tool_grammar; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
