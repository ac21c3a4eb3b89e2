"""Benchmark: journal bytes per turn over one long conversation, request bodies as deltas vs stored whole.

One conversation of N turns (default 50) goes through the real proxy (`legorl proxy`'s ASGI app under
uvicorn, journal fsync'd, bodies recorded as shipped) to the fake engine of `legorl.proxy.testing`, each
turn sending the whole history, as a coding harness does: a 2 KB system prompt, a user message and a
256-byte answer per turn. The journal is then read back (every body must come back byte for byte as
sent) and measured two ways in the same run:

- as written: each turn's `request_body` a delta against the previous turn's (`legorl.proxy.journal`);
- stored whole: the same records encoded without a previous body, which is how every turn was stored
  before the deltas (the same encoder, so the difference is the deltas alone).

Usage: python benchmarks/journal_bytes.py [--turns 50] [--out benchmarks/results/journal_bytes.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from provenance import git_commit  # noqa: E402

from legorl.proxy.app import ProxyApp  # noqa: E402
from legorl.proxy.journal import FILENAME, encode_record, read_journal  # noqa: E402
from legorl.proxy.settings import ProxySettings  # noqa: E402
from legorl.proxy.testing import FakeEngine  # noqa: E402
from tests.support.asgi_server import serve  # noqa: E402

FILLER = "the quick brown fox reads the repository, runs the tests, edits a file and reads the diff again; "


def run(turns: int, system_bytes: int, reply_bytes: int) -> dict[str, Any]:
    system = (FILLER * (system_bytes // len(FILLER) + 1))[:system_bytes]
    sent: list[str] = []
    with tempfile.TemporaryDirectory(prefix="journal-bytes-") as workdir, serve(FakeEngine()) as engine:
        journal = Path(workdir) / "journal"
        with serve(ProxyApp(ProxySettings(upstream=engine, journal=journal))) as proxy:
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
            with httpx.Client(base_url=proxy, timeout=60) as client:
                for turn in range(turns):
                    reply = (f"turn {turn}: " + FILLER * (reply_bytes // len(FILLER) + 1))[:reply_bytes]
                    messages.append({"role": "user", "content": f"SAY:{reply}"})
                    body = json.dumps({"model": "policy", "messages": messages})
                    sent.append(body)
                    answer = client.post(
                        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
                    )
                    answer.raise_for_status()
                    messages.append(
                        {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]}
                    )
        written = (journal / FILENAME).stat().st_size
        records = read_journal(journal).records
    turn_records = [r for r in records if r["type"] == "turn"]
    if [r["request_body"] for r in turn_records] != sent:
        raise SystemExit("a request body did not read back as sent")
    whole = sum(len(encode_record(r)) for r in records)
    bodies = sum(len(b.encode()) for b in sent)
    return {
        "turns": turns,
        "journal_bytes": {"deltas": written, "whole": whole},
        "bytes_per_turn": {"deltas": written / turns, "whole": whole / turns},
        "ratio_deltas_to_whole": written / whole,
        "request_body_bytes_sent": bodies,
        "last_request_body_bytes": len(sent[-1].encode()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--system-bytes", type=int, default=2048)
    parser.add_argument("--reply-bytes", type=int, default=256)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here (under benchmarks/results/)")
    args = parser.parse_args(argv)
    figures = run(args.turns, args.system_bytes, args.reply_bytes)
    document = {
        "git_commit": git_commit(),
        "what": (
            f"one {args.turns}-turn conversation through the real proxy (fake engine, fsync on, bodies "
            f"recorded), {args.system_bytes} B system prompt, {args.reply_bytes} B per user message and "
            "answer; 'whole' is the same records encoded without deltas"
        ),
        **figures,
    }
    per = figures["bytes_per_turn"]
    print(
        f"{args.turns} turns: {per['deltas']:,.0f} journal bytes per turn with deltas, {per['whole']:,.0f} "
        f"stored whole ({figures['ratio_deltas_to_whole']:.1%}); last request body "
        f"{figures['last_request_body_bytes']:,} B"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
