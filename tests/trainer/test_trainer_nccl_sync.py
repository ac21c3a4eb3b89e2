"""NCCL weight sync from a multi-rank trainer to a multi-replica fleet, as far as it runs without GPUs.

What is real: the trainer's ranks under torchrun (gloo, TP2 × EP2 on four ranks), its `TrainingService`,
the gather of the weights over the layout that feeds the broadcast, `NcclWeightSync`'s HTTP sequence on every
replica and its report. What stands in: NCCL and vLLM's CUDA transfer engine (`RecordingTransfer` in
tests/support/trainer_ranks.py makes the same client calls and reads the source the same way, and keeps what
it would
have broadcast), and the replicas' control routes (a small HTTP server per replica here, recording the calls
and answering `/weight_info` from `/update_weight_version`). The broadcast itself runs on a GPU only
(benchmarks/gpu_check.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "trainer_ranks.py"


class Replica:
    """One engine replica's dev-mode control routes, recorded."""

    def __init__(self, workers: int, address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.calls: list[str] = []
        self.version = "default"
        self.workers = workers
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def _answer(self, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = urlparse(self.path).path
                replica.calls.append(f"GET {path}")
                if path == "/get_world_size":
                    self._answer({"world_size": replica.workers})
                elif path == "/weight_info":
                    self._answer({"weight_version": replica.version})
                else:
                    self.send_error(404)

            def do_POST(self) -> None:
                path = urlparse(self.path).path
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                replica.calls.append(f"POST {path}")
                if path == "/update_weight_version":
                    replica.version = body["new_version"]
                elif path == "/finish_weight_update" and body.get("weight_version"):
                    replica.version = body["weight_version"]
                self._answer({"success": True})

        self.server = ThreadingHTTPServer(address, Handler)
        self.port = int(self.server.server_address[1])
        self.url = f"http://{address[0]}:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    fleet = [Replica(workers=2), Replica(workers=4)]
    yield fleet
    for replica in fleet:
        replica.server.shutdown()
        replica.server.server_close()


def test_nccl_sync_sends_the_gathered_weights_to_every_replica(
    replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("nccl")
    tiny, template = root / "tiny", root / "template"
    subprocess.run(
        [sys.executable, str(WORKER), "make", "--tiny", str(tiny), "--store", str(template)],
        check=True,
        cwd=REPO,
    )
    store = root / "store"
    shutil.copytree(template, store)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        str(WORKER), "run", "--tiny", str(tiny), "--store", str(store), "--out", str(root / "out.pt"),
        "--tp", "2", "--ep", "2", "--steps", "2", *(a for r in replicas for a in ("--fleet", r.url)),
    ]  # fmt: skip
    done = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]

    # Every step broadcast exactly the weights the writer published for it, gathered over TP2 × EP2.
    for step in (1, 2):
        sent = torch.load(root / "nccl" / f"round-{step}.pt", weights_only=True)
        published = {}
        for f in sorted((store / "weights" / f"v{step}").glob("*.safetensors")):
            published.update(load_file(str(f)))
        assert sent.keys() == published.keys()
        assert all(torch.equal(sent[name], tensor) for name, tensor in published.items())
    assert not (root / "nccl" / "round-3.pt").exists()

    # Every replica: the group's ranks counted once, the transfer engine set up once, then per step the
    # pause, the round (start, update, finish), the version, the cache reset, the resume and the check.
    per_step = [
        "POST /pause",
        "POST /start_weight_update",
        "POST /update_weights",
        "POST /finish_weight_update",
        "POST /update_weight_version",
        "POST /reset_prefix_cache",
        "POST /resume",
        "GET /weight_info",
    ]
    for replica in replicas:
        assert replica.calls == [
            "GET /get_world_size",
            "POST /init_weight_transfer_engine",
            "GET /weight_info",  # the catch-up check at start: the fleet serves the initial weights
            *per_step,
            *per_step,
        ], replica.calls
        assert replica.version == "v2"
    figures = json.loads((store / "metrics" / "trainer" / "step-000002.json").read_text())
    total = sum(t.numel() * t.element_size() for t in sent.values())
    assert figures["sync_bytes"] == total and figures["sync_seconds"] > 0


def test_a_dns_name_reaches_every_replica_behind_it(tmp_path: Path) -> None:
    """`dns+http://name:port` (the operator's headless Service of the serving pods) is every address the name
    has, looked up at every sync: two replicas on 127.0.0.1 and 127.0.0.2, the same port, both synced."""
    from legorl.trainer.sync.fleet_sync import FleetWeightSync  # noqa: PLC0415
    from legorl.trainer.sync.publish import WeightSyncError, publish_weights  # noqa: PLC0415

    first = Replica(workers=1)
    second = Replica(workers=1, address=("127.0.0.2", first.port))
    names = {"engines.rl.svc": ["127.0.0.2", "127.0.0.1"]}
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    weights = {"w": torch.ones(3)}
    published = publish_weights(weights, tmp_path / "v1", version="v1", source_dir=source, strict=False)
    try:
        fleet = FleetWeightSync(
            [f"dns+http://engines.rl.svc:{first.port}"],
            resolve=lambda host, _port: names[host],
            retry_delay=0.0,
        )
        with fleet:
            fleet.sync(published)
            assert fleet.base_urls == [f"http://127.0.0.1:{first.port}", f"http://127.0.0.2:{first.port}"]
            assert fleet.served_versions() == ["v1", "v1"]
            names["engines.rl.svc"] = []  # no replica ready: said so, not a silent no-op
            with pytest.raises(WeightSyncError, match=r"no address behind engines\.rl\.svc"):
                fleet.served_versions()
        for replica in (first, second):
            assert "POST /update_weights" in replica.calls and replica.version == "v1"
    finally:
        for replica in (first, second):
            replica.server.shutdown()
            replica.server.server_close()
