"""The Dockerfile and .dockerignore, read as text (no Docker engine needed)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCH_PIN = "torch==2.13.0"


def dockerfile() -> str:
    return (REPO_ROOT / "Dockerfile").read_text()


def instructions() -> list[str]:
    """The Dockerfile's instructions, comments dropped and continuation lines joined."""
    lines = [line for line in dockerfile().splitlines() if not line.lstrip().startswith("#")]
    return [" ".join(part.split()) for part in re.split(r"(?<!\\)\n", "\n".join(lines).replace("\\\n", " "))
            if part.strip()]


def test_base_image_is_python_3_11_slim():
    assert instructions()[0].startswith("FROM python:3.11-slim")


def stages() -> dict[str, list[str]]:
    """Each build stage's instructions, by its name (`FROM ... AS name`)."""
    named: dict[str, list[str]] = {}
    for line in instructions():
        if line.startswith("FROM "):
            current = named.setdefault(line.split()[-1], [])
        current.append(line)
    return named


def test_torch_is_pinned_once_in_pyproject():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert TORCH_PIN in project["optional-dependencies"]["engine"]
    assert not any(d.startswith("torch") for d in project["dependencies"])
    # The Dockerfile takes the pin from pyproject instead of repeating (and drifting from) it.
    assert not any("torch==" in line for line in instructions())
    assert any(line.startswith("COPY pyproject.toml") for line in instructions())


def test_pip_uses_the_cpu_torch_index_by_default():
    full = stages()["full"]
    args = [line for line in full if line.startswith("ARG TORCH_INDEX_URL=")]
    assert args == ["ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"]
    pip_installs = [line for line in full if "pip install" in line]
    assert pip_installs and all('--extra-index-url "$TORCH_INDEX_URL"' in line for line in pip_installs)
    assert any('pip install --extra-index-url "$TORCH_INDEX_URL" ".[engine]"' in line for line in pip_installs)
    assert any("optional-dependencies']['engine']" in line for line in full)


def test_the_light_image_has_no_engine_extra():
    """The gateway's and tokenizer's image: pyproject's dependencies, then the source with none more."""
    light = stages()["light"]
    pip_installs = [line for line in light if "pip install" in line]
    assert any("['project']['dependencies']" in line and "-r /tmp/requirements.txt" in line for line in pip_installs)
    assert any("pip install --no-deps ." in line for line in pip_installs)
    assert not any("[engine]" in line or "['engine']" in line or "TORCH_INDEX_URL" in line for line in pip_installs)
    assert stages()["full"] == instructions()[-len(stages()["full"]):], "full is the last stage: the default target"


def test_runs_as_a_non_root_user():
    for name in ("light", "full"):
        users = [line.split()[1] for line in stages()[name] if line.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), name


def test_no_model_weights_are_copied():
    copies = [line for line in instructions() if line.startswith(("COPY", "ADD"))]
    assert not any(re.search(r"safetensors|\.bin\b|/models", line) for line in copies)


def test_dockerignore_keeps_environments_caches_and_weights_out():
    patterns = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", ".pytest_cache", ".hypothesis", "**/__pycache__", "**/*.safetensors"} <= patterns
