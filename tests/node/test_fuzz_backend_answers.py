"""[upstream-bounds] Fuzz the answers a backend sends: the Node fails a run only with its typed upstream errors.

Structure-aware answers from a :class:`~node.harness.HostileBackend` on a real
loopback socket: 1xx answers before the final one, heads of any size, bodies
framed by ``content-length`` (true, or a lie either way), by chunks (with
extensions and trailers of any length) or by the connection's close, every
piece sent in reads cut at random, the connection closed at the end or cut
short. The run's relay (:meth:`HttpUpstream.relay_post`, read by the session's
body poller or by the run itself, stream or non-stream) must end or raise a :class:`~iop_node.RunFailed`
(``upstream_error``, ``upstream_unreachable``, ``upstream_too_large``) and
nothing else, a non-stream run never hands on more than ``answer_bytes``, and
the provider's one pool slot is back: the next run is served (or, when the
backend sent bytes past its answer's end late, fails typed once and the run
after it is served). Small limits
make every bound reachable in a small example. The number of examples is the
Hypothesis profile's (``ci`` in ``make test``, ``soak`` for a long run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import trio
from hypothesis import event, given
from hypothesis import strategies as st

from iop_node import ProviderConfig, RunFailed, UpstreamLimits
from iop_node.upstream.http_upstream import HttpUpstream
from iop_node.upstream.poller import RunOutput, new_poller
from node.harness import HEALTHY_ANSWER, HostileBackend, healthy

LIMITS = UpstreamLimits(head_bytes=2048, answer_bytes=4096, chunk_extension_bytes=256, informational_answers=2)
EXAMPLE_TIMEOUT = 20.0

tokens = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)


@st.composite
def heads(draw: st.DrawFn, status: int, framing: list[tuple[str, str]]) -> bytes:
    """A status line and fields, some of them long, around the framing fields given."""
    fields = draw(
        st.lists(st.tuples(tokens, st.text(alphabet="abc ;=", max_size=draw(st.sampled_from([8, 3000])))), max_size=4)
    )
    fields += framing
    fields = draw(st.permutations(fields))
    lines = [f"HTTP/1.1 {status} {draw(st.sampled_from(['OK', 'Continue', '', 'Early Hints']))}"]
    lines += [f"{name}: {value}" for name, value in fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@st.composite
def chunked_bodies(draw: st.DrawFn) -> bytes:
    """Chunks of any size, some with extensions of any length, then trailers (or not)."""
    parts = []
    for data in draw(st.lists(st.binary(min_size=1, max_size=1500), max_size=6)):
        extension = draw(st.sampled_from([b"", b";a=b", b";" + b"x" * 300]))
        parts.append(b"%x%b\r\n%b\r\n" % (len(data), extension, data))
    trailers = draw(st.sampled_from([b"", b"x-t: v\r\n", b"x-t: " + b"v" * 300 + b"\r\n"]))
    return b"".join(parts) + b"0\r\n" + trailers + b"\r\n"


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    """One answer as a backend could send it, good or bad."""
    informational = b"".join(
        draw(heads(status, [])) for status in draw(st.lists(st.sampled_from([100, 102, 103]), max_size=3))
    )
    status = draw(st.sampled_from([200, 200, 200, 204, 500]))
    size = draw(st.sampled_from([0, 10, 4096, 5000]))
    body = draw(st.binary(min_size=size, max_size=size))
    framing = draw(st.sampled_from(["length", "lying-length", "chunked", "close"]))
    event(f"framing: {framing}")
    if framing == "chunked":
        return informational + draw(heads(status, [("transfer-encoding", "chunked")])) + draw(chunked_bodies())
    if framing == "close":
        return informational + draw(heads(status, [])) + body
    declared = len(body) if framing == "length" else draw(st.integers(min_value=0, max_value=2 * len(body) + 10))
    return informational + draw(heads(status, [("content-length", str(declared))])) + body


def sent_in_pieces(data: bytes, cuts: list[int]) -> Callable[[], Iterator[bytes]]:
    def script() -> Iterator[bytes]:
        start = 0
        for cut in sorted(c % (len(data) + 1) for c in cuts):
            if cut > start:
                yield data[start:cut]
                start = cut
        yield data[start:]

    return script


@pytest.mark.req("upstream-bounds")
@given(answer=answers(), cuts=st.lists(st.integers(min_value=0), max_size=6), whole=st.booleans(), polled=st.booleans())
async def test_a_run_fails_only_with_typed_upstream_errors(
    answer: bytes, cuts: list[int], whole: bool, polled: bool
) -> None:
    backend = HostileBackend(script=sent_in_pieces(answer, cuts))
    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        base_url = f"http://127.0.0.1:{backend.port}/v1"
        provider = ProviderConfig(
            id="p", adapter="openai", base_url=base_url, timeout_ms=5_000, connect_timeout_ms=5_000, limits=LIMITS
        )
        upstream = HttpUpstream.for_provider(provider, f"http://127.0.0.1:{backend.port}")
        received: list[bytes] = []

        async def put(chunk: bytes) -> None:
            received.append(chunk)

        async def room() -> bool:
            return False

        poller = new_poller(nursery, room) if polled else None
        send = RunOutput(put, received.append, poller)

        with trio.fail_after(EXAMPLE_TIMEOUT):
            try:
                await upstream.relay_post(f"{base_url}/chat/completions", {"model": "m"}, send, whole=whole)
            except RunFailed as exc:
                event(f"failed: {exc.code}")
            else:
                event("served")
            if whole:
                assert sum(map(len, received)) <= LIMITS.answer_bytes
            backend.script = healthy
            received.clear()
            try:
                await upstream.relay_post(f"{base_url}/chat/completions", {"model": "m"}, send, whole=True)
            except RunFailed:
                # A body longer than its content-length, its last piece sent after the answer
                # ended and the connection went back idle, is read by the next request on that
                # connection (no HTTP/1.1 client can tell it from the next answer): that one
                # run fails typed, the connection is dropped, and the run after it is served.
                event("the next run read the answer's late bytes")
                received.clear()
                await upstream.relay_post(f"{base_url}/chat/completions", {"model": "m"}, send, whole=True)
            assert b"".join(received) == HEALTHY_ANSWER
            await upstream.aclose()
        nursery.cancel_scope.cancel()
