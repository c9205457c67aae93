"""How the OpenAI HTTP API is served to browsers, over TLS, behind a proxy and in the log, with
vLLM's flags and defaults.

CORS (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials): as vLLM,
any origin by default, so a browser page may call the API (with the API key, where one is asked
for). Preflight requests are answered before the key is asked for, and refusals carry the CORS
headers too, so a page can read why it was refused.

TLS (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs): the HTTP API over HTTPS,
the certificate and key checked as the gateway starts; with --ssl-cert-reqs 2 clients must show a
certificate signed by --ssl-ca-certs. The gRPC Generate API is not on TLS (vLLM has none to follow).

Behind a proxy that serves the API under a path prefix and strips it (--root-path /prefix): requests
arrive without it, and the prefix is the ASGI root_path, as vLLM passes it to uvicorn.

The access log: one line per HTTP request (client, method, path, status) on the logger
`uvicorn.access`, in the gateway's log, as vLLM and SGLang write it by default;
--disable-uvicorn-access-log leaves it out, and --uvicorn-log-level sets how much uvicorn says.
"""
from __future__ import annotations

import argparse
import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware

from services.common.settings import ConfigError, env_flag

ENV_ALLOWED_ORIGINS = "BATON_GATEWAY_ALLOWED_ORIGINS"
ENV_SSL_KEYFILE = "BATON_GATEWAY_SSL_KEYFILE"
ENV_SSL_CERTFILE = "BATON_GATEWAY_SSL_CERTFILE"
ENV_ROOT_PATH = "BATON_GATEWAY_ROOT_PATH"
ENV_DISABLE_ACCESS_LOG = "BATON_GATEWAY_DISABLE_ACCESS_LOG"
CERT_REQS = {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional", ssl.CERT_REQUIRED: "required"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class HttpServing:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = ssl.CERT_NONE
    root_path: str = ""  # the prefix a proxy serves the API under and strips
    access_log: bool = True
    log_level: str = "info"  # uvicorn's own loggers' (the access log's among them)

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError(f"--root-path must start with / and not end with one, e.g. /llm; "
                              f"got {self.root_path!r}")
        if self.log_level not in UVICORN_LOG_LEVELS:
            raise ConfigError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                              f"got {self.log_level!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither")
        if self.ssl_cert_reqs not in CERT_REQS:
            raise ConfigError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), "
                              f"got {self.ssl_cert_reqs}")
        if self.ssl_cert_reqs != ssl.CERT_NONE and not self.ssl_ca_certs:
            raise ConfigError("--ssl-cert-reqs asks clients for certificates: give --ssl-ca-certs to check them by")
        if self.ssl_certfile is not None:
            self._check_files()

    def _check_files(self) -> None:
        """Refused at start, by name, rather than by uvicorn once the API is said to be up."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"--ssl-certfile {self.ssl_certfile} / --ssl-keyfile {self.ssl_keyfile}: {e}") from None
        if self.ssl_ca_certs:
            try:
                context.load_verify_locations(self.ssl_ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"--ssl-ca-certs {self.ssl_ca_certs}: {e}") from None

    @property
    def is_tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def scheme(self) -> str:
        return "https" if self.is_tls else "http"

    def uvicorn_options(self) -> dict:
        # log_config None: uvicorn's loggers write through the gateway's own handler and format,
        # not handlers of their own (its access log's on stdout, which nobody may be reading).
        options = dict(root_path=self.root_path, access_log=self.access_log, log_level=self.log_level,
                       log_config=None)
        if self.is_tls:
            options.update(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile,
                           ssl_ca_certs=self.ssl_ca_certs, ssl_cert_reqs=self.ssl_cert_reqs)
        return options

    def add_cors(self, app) -> None:
        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
        parser.add_argument("--allowed-origins", type=_json_list("--allowed-origins"),
                            default=env.get(ENV_ALLOWED_ORIGINS) or '["*"]',
                            help=f"CORS: the origins browser pages may call the HTTP API from, a JSON list "
                                 f"(default [\"*\"], any, as vLLM) (${ENV_ALLOWED_ORIGINS})")
        parser.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default='["*"]',
                            help="CORS: the methods they may use, a JSON list (default [\"*\"])")
        parser.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default='["*"]',
                            help="CORS: the headers they may send, a JSON list (default [\"*\"])")
        parser.add_argument("--allow-credentials", action="store_true",
                            help="CORS: let them send cookies and HTTP authentication")
        parser.add_argument("--ssl-keyfile", default=env.get(ENV_SSL_KEYFILE) or None,
                            help=f"serve the HTTP API over TLS with this private key (PEM) (${ENV_SSL_KEYFILE})")
        parser.add_argument("--ssl-certfile", default=env.get(ENV_SSL_CERTFILE) or None,
                            help=f"... and this certificate chain (PEM) (${ENV_SSL_CERTFILE})")
        parser.add_argument("--ssl-ca-certs", default=None,
                            help="the CA certificates client certificates are checked by (PEM)")
        parser.add_argument("--ssl-cert-reqs", type=int, default=ssl.CERT_NONE,
                            help="client certificates: 0 not asked for (default), 1 checked if shown, 2 required")
        parser.add_argument("--root-path", default=env.get(ENV_ROOT_PATH) or "",
                            help=f"the path prefix a proxy serves the HTTP API under and strips from what it "
                                 f"forwards, e.g. /llm (${ENV_ROOT_PATH})")
        parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                            default=env_flag(env, ENV_DISABLE_ACCESS_LOG),
                            help=f"no line per HTTP request in the log (${ENV_DISABLE_ACCESS_LOG}=1)")
        parser.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                            help="how much the HTTP server logs (default info: with the access log)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpServing:
        # argparse applies `type` to a string default too, so each list is parsed here either way.
        return cls(allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                   allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
                   ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                   ssl_cert_reqs=args.ssl_cert_reqs, root_path=args.root_path,
                   access_log=not args.disable_uvicorn_access_log, log_level=args.uvicorn_log_level)


def _json_list(flag: str):
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of strings: {e}") from None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of strings, e.g. '[\"https://a.example\"]'")
        return value
    return parse
