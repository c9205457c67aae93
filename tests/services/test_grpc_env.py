"""services/common/grpc_env.py: every service sets gRPC's I/O path before anything imports grpc,
the pinned grpcio knows the experiments it names, and an operator's own setting is kept."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from services.common import grpc_env
from tests.services.service_process import REPO_ROOT

SERVICES = ("gateway", "tokenizer", "prefill", "decode", "kvstore")


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env=env)


def test_the_pinned_grpcio_knows_every_experiment_named():
    done = run_python("import grpc; grpc.insecure_channel('127.0.0.1:9').close()",
                      env={grpc_env.VARIABLE: grpc_env.EXPERIMENTS, "PATH": ""})
    assert done.returncode == 0, done.stderr
    assert "Unknown experiment" not in done.stderr, done.stderr
    # The check can fail: a name grpcio does not know is reported.
    unknown = run_python("import grpc", env={grpc_env.VARIABLE: "-no_such_experiment", "PATH": ""})
    assert "Unknown experiment: no_such_experiment" in unknown.stderr


def test_importing_it_sets_the_variable_and_keeps_an_operators_own():
    show = "import services.common.grpc_env, os; print(os.environ['GRPC_EXPERIMENTS'])"
    assert run_python(show, env={"PATH": ""}).stdout.strip() == grpc_env.EXPERIMENTS
    assert run_python(show, env={"PATH": "", grpc_env.VARIABLE: "tcp_rcv_lowat"}).stdout.strip() == "tcp_rcv_lowat"


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_imports_it_before_anything_that_could_import_grpc(service):
    """Only the standard library may come first: grpc reads the variable once, on import."""
    tree = ast.parse((REPO_ROOT / "services" / service / "__main__.py").read_text())
    imported = [(node.names[0].name if isinstance(node, ast.Import) else node.module)
                for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    first_of_ours = next(name for name in imported if name.split(".")[0] not in sys.stdlib_module_names)
    assert first_of_ours == "services.common.grpc_env", imported
