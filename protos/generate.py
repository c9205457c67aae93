"""Regenerate the committed *_pb2.py, *_pb2.pyi and *_pb2_grpc.py beside each .proto.

    python -m protos.generate           # rewrite them in place
    python -m protos.generate OUT_DIR   # write them under OUT_DIR/protos/ instead

Always runs protoc from the repository root with `-I .`, so imports are written
`from protos import common_pb2` and need no rewriting (STYLE.md, rule 6).
tests/services/test_grpc_common.py regenerates into a temp dir and compares
bytes, so a .proto edited without regenerating fails the tests.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent


def proto_files() -> list[Path]:
    """Every .proto, relative to the repository root, in a stable order."""
    return sorted(p.relative_to(REPO_ROOT) for p in PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Run grpc_tools.protoc; return the generated files under `out_dir`."""
    out_dir = Path(out_dir).resolve()
    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    protos = [str(p) for p in proto_files()]
    # `python -m grpc_tools.protoc` (not grpc_tools.protoc.main) because its
    # __main__ adds the bundled well-known types to the include path.
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".",
         f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos],
        cwd=REPO_ROOT,
        check=True,
    )
    return sorted(generated_files(out_dir))


def generated_files(root: Path = REPO_ROOT) -> list[Path]:
    """The generated modules under `root`/protos/."""
    d = Path(root) / "protos"
    return sorted([*d.glob("*_pb2.py"), *d.glob("*_pb2.pyi"), *d.glob("*_pb2_grpc.py")])


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT):
        print(path)
