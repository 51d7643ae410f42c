"""``quickdraft serve``: an OpenAI-compatible HTTP server (chat and text completions, streaming,
structured output, tool calling, Prometheus metrics) over one model, with lossless speculative decoding.

Listens on 127.0.0.1 unless --host says otherwise; with --api-key (or $QUICKDRAFT_API_KEY),
every route but /health and the chat page needs ``Authorization: Bearer KEY``. --port 0 picks a
free port; the URL is printed on stdout once the server accepts connections, with the chat page's
(at /, unless --no-webui).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from types import FrameType

from quickdraft.cli.common import add_engine_flags, add_model_args, info, load_llm
from quickdraft.errors import QuickdraftError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1, this machine only)",
    )
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 = any free port)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("QUICKDRAFT_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $QUICKDRAFT_API_KEY, else none)",
    )
    g.add_argument(
        "--served-model-name",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name clients send; repeat it (or give several) for aliases, the first "
        "being the name responses report (default: the --model argument)",
    )
    g.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "hermes", "llama3_json", "mistral", "none"],
        help="how the model writes tool calls (default: auto, from the chat template's markers; "
        "none: refuse requests with tools)",
    )
    g.add_argument(
        "--no-webui",
        dest="webui",
        action="store_false",
        help="do not serve the chat page at / (the API is the same either way)",
    )
    # the engine runs one sequence unless asked (LLM.generate, the one-user commands); a server
    # is where requests arrive at once, so it takes as many as the memory allows
    add_engine_flags(g, ("max_concurrency",), defaults={"max_concurrency": None})
    g.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default: warning)",
    )
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from quickdraft.server import create_app

    if not 0 <= args.port <= 65535:
        raise QuickdraftError(f"--port must be in 0..65535, got {args.port}")
    sock = _bind(args.host, args.port)  # before loading: a busy port fails fast
    llm = load_llm(args, info)
    names = list(dict.fromkeys(args.served_model_name or [args.model]))
    name = names[0]
    if not args.api_key and not _is_loopback(args.host):
        info(
            f"warning: listening on {args.host} without --api-key: anyone who can reach it can use it"
        )
    app = create_app(
        llm, names, api_key=args.api_key, tool_call_parser=args.tool_call_parser, webui=args.webui
    )
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    # The socket already listens: a client that connects now waits in the backlog until
    # uvicorn accepts, so the URL is usable as soon as it is printed.
    also = f" (also as {', '.join(names[1:])})" if len(names) > 1 else ""
    page = f"; chat page at {url}/" if args.webui else ""
    print(f"quickdraft: serving {name} at {url}/v1{also}{page}", flush=True)
    worker = app.state.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            worker.cancel_all()  # open streams end now instead of holding up the shutdown
            super().handle_exit(sig, frame)

    Server(config).run(sockets=[sock])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise QuickdraftError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
