"""The gateway and the tokenizer service run without torch: neither computes a tensor, and torch
was a quarter of a gigabyte and two seconds of every gateway's start (the model's checkpoint
fingerprint, its KV layout and its default block size are read without it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("service", ["gateway", "tokenizer"])
def test_the_service_imports_no_torch(service):
    check = (f"import sys, services.{service}.__main__; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    loaded = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
