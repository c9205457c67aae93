"""The gateway and the tokenizer service run without pyproject's `engine` extra (torch and what only
the workers read): neither computes a tensor, the Dockerfile's `light` image holds none of it, and
torch was a quarter of a gigabyte and two seconds of every gateway's start. The model's checkpoint
fingerprint, its KV layout and its default block size are read without it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def engine_distributions() -> set[str]:
    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engine"]
    return {re.split(r"[<>=~!\[ ;]", requirement)[0].lower() for requirement in extra}


@pytest.mark.parametrize("module", ["services.gateway.__main__", "services.tokenizer.__main__",
                                    "services.common.healthcheck"])
def test_the_service_imports_nothing_of_the_engine_extra(module):
    check = (f"import importlib.metadata as md, json, sys, {module}; "
             "dists = md.packages_distributions(); "
             "print(json.dumps(sorted({d.lower() for m in list(sys.modules) "
             "for d in dists.get(m.split('.')[0], [])})))")
    loaded = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    distributions = set(json.loads(loaded.stdout))
    assert {"torch", "numpy"} <= engine_distributions()
    assert not distributions & engine_distributions(), distributions & engine_distributions()


@pytest.mark.parametrize("kind", ["prefill", "decode", "kvstore"])
def test_a_worker_reads_its_flags_before_importing_torch(kind):
    """`python -m services.<worker> --help`, or a mistyped flag in a compose file, answers without the two
    seconds of torch's import: the service itself (services/<worker>/service.py) is imported once they are read."""
    check = ("import sys; from services.%s.__main__ import main\n"
             "try:\n    code = main(['--no-such-flag'])\nexcept SystemExit as e:\n    code = e.code\n"
             "print(code, 'torch' in sys.modules)" % kind)
    answered = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert answered.stdout.split() == ["2", "False"], answered.stderr
    assert "--no-such-flag" in answered.stderr
