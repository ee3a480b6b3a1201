"""``iop-mock-backend``: the command line, and serving a :class:`~iop_mock.MockBackend` on a port."""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys

import trio

from ._server import serve_asgi
from .backend import MockBackend
from .kv import MODES
from .kv_driver import KvDriver


async def serve_mock_backend(
    backend: MockBackend,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``backend.app`` over HTTP/1.1 (:mod:`iop_http` framing on trio sockets) until cancelled.

    Use with ``port = await nursery.start(serve_mock_backend, backend)``. Nothing is logged per
    request; an exception in the app is logged by the ``iop_mock.server`` logger (the request
    gets a 500 if its response had not started, and its connection closes).

    Args:
        backend: the backend whose app and counters are served.
        host: address to bind; the default is loopback only.
        port: TCP port; 0 picks a free one.
        task_status: receives the actual bound port once the socket listens.

    Raises:
        OSError: the address cannot be bound.

    Checkpoints. Runs until cancelled; cancellation closes the listener and every open
    connection at once (responses in progress end, their in-flight counts are released).
    """
    async with trio.open_nursery() as nursery:
        bound_port = await nursery.start(functools.partial(serve_asgi, backend.app, host, port))
        task_status.started(bound_port)


def _add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV budget's options (docs/mock.md)."""
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=0,
        help="run generations in a KV cache of this many tokens (preempting or failing when full); 0 = off (default)",
    )
    parser.add_argument("--n-ctx", type=int, default=None, help="tokens one sequence may hold (default: --kv-tokens)")
    parser.add_argument(
        "--kv-mode",
        choices=MODES,
        default="preempt",
        help=(
            "a full cache evicts the newest sequence to recompute it (preempt: vLLM), fails every sequence"
            " in progress (fail: llama.cpp), or fails the newest only (fail-newest)"
        ),
    )
    parser.add_argument(
        "--prefill-tokens-per-second",
        type=float,
        default=0.0,
        help="with --kv-tokens: prompt tokens prefilled per second, 0 = prefill costs only its step (default 0)",
    )
    parser.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=8192,
        help="with --kv-tokens: the most prompt tokens one step prefills (chunked prefill; default 8192)",
    )
    parser.add_argument(
        "--kv-read-ns",
        type=float,
        default=0.0,
        help="with --kv-tokens: nanoseconds a step costs per cache entry in use (default 0)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="iop-mock-backend",
        description="OpenAI/Ollama-compatible fake LLM backend that counts in-flight requests.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9100, help="TCP port, 0 = any (default 9100)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="time to first token (default 0)")
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=0.0,
        help="generation speed, 0 = as fast as possible (default 0)",
    )
    parser.add_argument(
        "--prompt-chars-per-token",
        type=float,
        default=4.0,
        help="prompt characters per prompt token reported in usage (default 4, the Edge's estimate)",
    )
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        help="model id listed by /v1/models; repeatable (default: mock)",
    )
    parser.add_argument(
        "--fail-status",
        type=int,
        default=None,
        help="answer every generation request with this HTTP status (400-599); POST /fault changes it",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=4,
        help="the slots /slots reports, llama.cpp's --parallel: the Node's llama_cpp probe caps the provider at it (default 4)",
    )
    parser.add_argument(
        "--track-repeats",
        action="store_true",
        help="count requests whose body repeats one served before (repeated in /stats; for tests)",
    )
    _add_kv_arguments(parser)
    args = parser.parse_args(argv)
    _check(parser, args)
    return args


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with the usage when a figure is out of range."""
    if args.fail_status is not None and not 400 <= args.fail_status <= 599:
        parser.error("--fail-status must be an HTTP error status (400-599)")
    if args.latency_ms < 0 or args.tokens_per_second < 0:
        parser.error("--latency-ms and --tokens-per-second must be >= 0")
    if args.prompt_chars_per_token <= 0:
        parser.error("--prompt-chars-per-token must be > 0")
    if args.parallel < 1:
        parser.error("--parallel must be >= 1")
    if args.kv_tokens < 0 or (args.n_ctx is not None and args.n_ctx < 1) or args.prefill_tokens_per_second < 0:
        parser.error("--kv-tokens and --prefill-tokens-per-second must be >= 0, --n-ctx >= 1")
    if args.prefill_chunk_tokens < 1 or args.kv_read_ns < 0:
        parser.error("--prefill-chunk-tokens must be >= 1, --kv-read-ns >= 0")
    if args.kv_tokens == 0 and args.n_ctx is not None:
        parser.error("--n-ctx needs --kv-tokens")


def kv_of(args: argparse.Namespace) -> KvDriver | None:
    """The KV budget the command line asks for; None without ``--kv-tokens``."""
    if not args.kv_tokens:
        return None
    return KvDriver.build(
        args.kv_tokens,
        args.n_ctx or args.kv_tokens,
        args.kv_mode,
        tokens_per_second=args.tokens_per_second,
        prefill_tokens_per_second=args.prefill_tokens_per_second,
        prefill_per_step=args.prefill_chunk_tokens,
        read_seconds=args.kv_read_ns * 1e-9,
    )


async def run_backend(backend: MockBackend, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then close every connection and return.

    Checkpoints; runs until a signal or cancellation.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(functools.partial(serve_mock_backend, backend, host=host, port=port))
            url_host = f"[{host}]" if ":" in host else host
            print(f"iop-mock-backend listening on http://{url_host}:{bound}", file=sys.stderr, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``iop-mock-backend``; exits 0 on SIGINT or SIGTERM."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    models: list[str] = args.models or ["mock"]
    backend = MockBackend(
        latency=args.latency_ms / 1000.0,
        tokens_per_second=args.tokens_per_second,
        prompt_chars_per_token=args.prompt_chars_per_token,
        models=models,
        fail_status=args.fail_status,
        track_repeats=args.track_repeats,
        kv=kv_of(args),
        slots=args.parallel,
    )
    trio.run(run_backend, backend, args.host, args.port)


if __name__ == "__main__":
    main()
