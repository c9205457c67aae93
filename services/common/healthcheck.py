"""A container healthcheck: exit 0 when a service is up, 1 otherwise.

    python -m services.common.healthcheck 127.0.0.1:50051          # gRPC health, the whole server ("")
    python -m services.common.healthcheck 127.0.0.1:50052 --service baton.prefill.Prefill
    python -m services.common.healthcheck http://127.0.0.1:8000/health   # HTTP: any 2xx

compose.yaml runs it inside each service's container. A service reports NOT_SERVING
while it loads and warms up (services/common/entrypoint.py), so "healthy" means ready
for requests, not merely listening. Every failure prints one line on stderr.
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

TIMEOUT_S = 2.0


def check_grpc(address: str, service: str, timeout_s: float) -> str | None:
    """None when `address` reports SERVING for `service`, else why not."""
    import grpc  # here, so an HTTP check does not pay for importing grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return None


def check_http(url: str, timeout_s: float) -> str | None:
    """None when GET `url` answers 2xx, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, ValueError) as e:  # URLError, refused, timed out, malformed URL
        return str(e)
    return None if 200 <= status < 300 else f"HTTP {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("target", help="HOST:PORT for gRPC health, or an http:// URL")
    parser.add_argument("--service", default="", help='gRPC service name to check (default "": the whole server)')
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds (default {TIMEOUT_S:g})")
    args = parser.parse_args(argv)
    if args.target.startswith(("http://", "https://")):
        problem = check_http(args.target, args.timeout)
    else:
        problem = check_grpc(args.target, args.service, args.timeout)
    if problem is not None:
        print(f"healthcheck {args.target}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
