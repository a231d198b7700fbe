"""SGLang adapters against SGLang's real API as recorded from the pinned wheel (SGLang cannot run
on CPU): the spec's translation against the real ``ServerArgs`` fields and CLI flags, the
adapters against fakes that answer SGLang's real routes in its real formats (``/flush_cache`` in
plain text) and keep its rules (weight updates only inside ``begin/end_weight_update``).

The recorded API is ``tests/fixtures/sglang_0.5.23_api.json`` (``tests/fixtures/sglang_api.py``
says how it is made; with ``SGLANG_WHEEL`` set, it is checked against the wheel). The server
fake is a real HTTP server on 127.0.0.1 that answers only SGLang's real routes, whose
``/init_weights_update_group`` joins a real gloo group with the trainer and whose
``/update_weights_from_distributed`` receives the trainer's broadcasts.
"""

from __future__ import annotations

import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from megatron_stare.config.load import load_config
from megatron_stare.preflight.checks import validate_config
from megatron_stare.rollout import EngineWorld, SamplingParams, engine_for_rank
from megatron_stare.runtime.phases import EngineMemory
from megatron_stare.rollout.engines.sglang.engine import SGLangEngine, engine_kwargs
from megatron_stare.rollout.engines.sglang_server.engine import SGLangServerEngine, server_command
from megatron_stare.weight_sync import dtype_from_name, init_named_weight_group

from ..fixtures.fake_sglang.sglang.launch_server import FLUSHED, fake_generation
from ..fixtures.sglang_api import extract, recorded

API = recorded()
GPU_WORLD = EngineWorld(rank=0, world_size=4, local_rank=0, local_world_size=4, cuda=True, process_group=True)


def _type_ok(value, typ: str) -> bool:
    """``value`` fits SGLang's declared type (the scalar types the adapters send)."""
    if typ.startswith("Optional["):
        if value is None:
            return True
        typ = typ[len("Optional["):-1]
    checks = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "str": lambda v: isinstance(v, str), "bool": lambda v: isinstance(v, bool)}
    return checks[typ](value)


def _named(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(64, 32, generator=g)) for i in range(4)] + [
        ("model.norm.weight", torch.randn(32, generator=g).to(torch.bfloat16))]


def _config(tmp_path: Path, **rollout):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": "/models/policy", "dtype": "bfloat16"}, "data": {"max_prompt_length": 100},
        "rollout": {"max_new_tokens": 28, "gpu_memory_utilization": 0.4, **rollout}, "trainer": {"seed": 7}}))
    return validate_config(load_config(str(path)), world_size=4, cuda=True, check_paths=False)


# ---------------------------------------------------------------------------- the recorded API
def test_recorded_api_is_the_pinned_wheels():
    wheel = os.environ.get("SGLANG_WHEEL")
    pins = (Path(__file__).parents[2] / "requirements" / "gpu-sglang-constraints.txt").read_text()
    assert f"sglang=={API['sglang']}" in pins  # the record is of the release the GPU recipe pins
    if not wheel:
        pytest.skip("set SGLANG_WHEEL=path/to/sglang-<pinned>.whl to check the record against the wheel")
    assert extract(wheel) == API


# ---------------------------------------------------------------------------- the spec's translation
def test_spec_translates_into_real_server_args(tmp_path):
    from megatron_stare.rollout import EngineSpec

    cfg = _config(tmp_path, engine="sglang", tp=2)
    world = EngineWorld(rank=2, world_size=4, local_rank=2, local_world_size=4, cuda=True)
    kw = engine_kwargs(EngineSpec.from_config(cfg, world))
    bad = {k: v for k, v in kw.items()
           if k not in API["server_args"] or not _type_ok(v, API["server_args"][k]["type"])}
    assert not bad
    assert kw == {"model_path": "/models/policy", "tp_size": 2, "dtype": "bfloat16", "context_length": 128,
                  "mem_fraction_static": 0.4, "base_gpu_id": 2, "random_seed": 7, "skip_tokenizer_init": True,
                  "enable_memory_saver": True}
    # The names vLLM uses are not SGLang's: the old kwargs (max_model_len) would not exist there.
    assert "max_model_len" not in API["server_args"] and "tensor_parallel_size" not in API["server_args"]


def _parse_flags(argv):
    """SGLang's CLI, as recorded: ``{field: value}`` from ``--flag [value]`` tokens."""
    by_flag = {f: name for name, a in API["server_args"].items() for f in a["flags"]}
    out, i = {}, 0
    while i < len(argv):
        assert argv[i] in by_flag, f"{argv[i]} is not an SGLang server flag"
        name = by_flag[argv[i]]
        if API["server_args"][name]["store_true"]:
            out[name], i = True, i + 1
        else:
            typ = API["server_args"][name]["type"].removeprefix("Optional[").rstrip("]")
            out[name], i = {"int": int, "float": float, "str": str}[typ](argv[i + 1]), i + 2
    return out


def test_server_command_uses_real_flags_and_the_logprob_convention(tmp_path):
    from megatron_stare.rollout.server_cmd import command_for

    cfg = _config(tmp_path, engine="sglang-server", tp=2, server_urls=["http://rollout-node:31000"])
    spec, _ = engine_for_rank(cfg, EngineWorld(rank=1, world_size=4, cuda=True))  # no client on rank 1
    cmd = server_command(spec, "0.0.0.0", 31000)
    assert cmd.argv[1:3] == ("-m", "sglang.launch_server")
    assert _parse_flags(list(cmd.argv[3:])) == {
        "model_path": "/models/policy", "host": "0.0.0.0", "port": 31000, "tp_size": 2, "dtype": "bfloat16",
        "context_length": 128, "mem_fraction_static": 0.4, "random_seed": 7, "skip_tokenizer_init": True}
    # SGLang's sampler divides by the temperature unless this switch asks for raw log-probs.
    assert API["sampler_divides_by_temperature"] and cmd.env == {API["raw_logprob_env"]: "false"}
    line = command_for(cfg, "0.0.0.0", None)  # what a launch script runs; the URL's port
    assert line.startswith("SGLANG_RETURN_ORIGINAL_LOGPROB=false ") and "--port 31000" in line


# ---------------------------------------------------------------------------- colocated engine
# The colocated engine is this HTTP client against a server it spawns: tests/unit/test_sglang_colocated.py.
def test_colocated_engine_refuses_cpu_and_raw_logprobs(tmp_path, monkeypatch):
    import dataclasses

    from megatron_stare.errors import UserError
    from megatron_stare.rollout import EngineSpec

    spec = EngineSpec.from_config(_config(tmp_path, engine="sglang", tp=2), GPU_WORLD)
    with pytest.raises(UserError, match="the sglang engine needs a CUDA GPU"):
        SGLangEngine.from_spec(dataclasses.replace(spec, cuda=False))
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(UserError, match="SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return raw-logit"):
        SGLangEngine.from_spec(spec)  # before anything is spawned


# ---------------------------------------------------------------------------- server fake
class _FakeServerState:
    """The fake SGLang server's state; runs in its own process (a gloo group cannot be formed
    by two threads of one process: the backend's constructor holds the GIL)."""

    def __init__(self, info):
        self.calls, self.weights, self.in_update, self.group, self.info = [], {}, False, None, info

    def handle(self, path, b):
        if path == "/_inspect":  # test-only: what the server holds
            return {"calls": self.calls, "weights": {n: [t.double().sum().item(), str(t.dtype),
                                                         list(t.shape)] for n, t in self.weights.items()}}
        assert path in API["routes"], f"SGLang has no route {path}"
        self.calls.append(path)
        if path == "/server_info":
            return self.info
        if path == "/flush_cache":  # SGLang answers in plain text (srt/entrypoints/http_server.py:1025)
            return FLUSHED
        if path == "/init_weights_update_group":
            assert b["rank_offset"] == 1 and b["world_size"] == 2
            self.group = init_named_weight_group(b["master_address"], b["master_port"], 1,
                                                 b["world_size"], b["group_name"], b["backend"])
        elif path == "/begin_weight_update":
            assert not self.in_update
            self.in_update = True
        elif path == "/end_weight_update":
            self.in_update = False
        elif path == "/update_weights_from_distributed":
            if not self.in_update:
                raise RuntimeError("refused outside begin/end_weight_update")
            for n, d, s in zip(b["names"], b["dtypes"], b["shapes"]):
                t = torch.empty(s, dtype=dtype_from_name(d))
                self.group.broadcast(t, 0).wait()
                self.weights[n] = t
        elif path == "/generate":
            return fake_generation(b["input_ids"], b["sampling_params"], self.weights)
        return {"success": True, "message": "ok"}


def _serve_fake(queue, info):
    state = _FakeServerState(info)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self, body):
            try:
                out, code = state.handle(self.path, body), 200
            except Exception as e:  # noqa: BLE001
                out, code = {"success": False, "message": repr(e)}, 400
            text = isinstance(out, str)
            data = out.encode() if text else json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}"))

        def do_GET(self):
            self._answer({})

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    queue.put(f"http://127.0.0.1:{httpd.server_address[1]}")
    httpd.serve_forever()


SERVER_INFO = {"tp_size": 1, "dtype": "bfloat16", "context_length": 4096, "skip_tokenizer_init": True}


def _fake_server_process():
    import multiprocessing as mp

    assert set(SERVER_INFO) <= set(API["server_args"])  # /server_info reports ServerArgs fields
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve_fake, args=(q, SERVER_INFO), daemon=True)
    proc.start()
    try:
        yield q.get(timeout=60)
    finally:
        proc.kill()
        proc.join()


#: A fake server, shared by the module's tests (it joins one weight group in its life).
fake_server = pytest.fixture(scope="module")(_fake_server_process)
#: One of its own, for a test that forms its own weight group.
own_fake_server = pytest.fixture(_fake_server_process)


def test_server_attaches_from_a_config_file_and_checks_the_server(fake_server, tmp_path):
    cfg = _config(tmp_path, engine="sglang-server", server_urls=[fake_server])
    spec, eng = engine_for_rank(cfg, GPU_WORLD)
    assert spec.devices.gpu_ids == () and eng.memory_release.frees is False  # GPUs of its own
    assert eng.world == 1 and eng.weight_backend == "nccl" and eng.group_host == "127.0.0.1"
    assert eng.release_memory() is False and eng.memory is EngineMemory.RELEASED
    eng.resume_weights(), eng.resume_kv_cache()
    bad = _config(tmp_path, engine="sglang-server", server_urls=[fake_server], tp=2, max_new_tokens=4000)
    with pytest.raises(ValueError) as e:
        engine_for_rank(bad, GPU_WORLD)
    assert str(e.value) == (f"sglang-server at {fake_server} does not match the run: tp_size 1 (the run needs 2), "
                            f"context_length 4096 (the run needs 4100); start it with the command "
                            f"`python -m megatron_stare.rollout.server_cmd` prints")


def test_server_adapter_distributed_update_over_gloo(fake_server, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # a torchrun worker (weight_sync/groups.py)
    eng = SGLangServerEngine(base_url=fake_server, weight_backend="gloo", bucket_bytes=20_000,
                             request_timeout_s=60)
    try:
        for seed in (0, 1):
            eng.update_weights(iter(_named(seed)))
            held = eng._post("/_inspect")["weights"]
            for n, t in _named(seed):
                assert held[n] == [t.double().sum().item(), str(t.dtype), list(t.shape)]
        calls = eng._post("/_inspect")["calls"]
        assert calls.count("/init_weights_update_group") == 1
        assert calls[calls.index("/update_weights_from_distributed") - 1] == "/begin_weight_update"
        assert calls[-2:] == ["/end_weight_update", "/flush_cache"]
        assert calls.count("/update_weights_from_distributed") > 2  # bucketed, twice
        params = SamplingParams(n=2, max_new_tokens=4, seed=1)
        res = eng.generate([[3, 4], [5]], params)
        rows = [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [(r.prompt_index, r.sample_index) for r in res] == rows
        assert len({tuple(r.token_ids) for r in res}) == 4
        assert [r.token_ids for r in eng.generate([[3, 4], [5]], params)] == [r.token_ids for r in res]
    finally:
        eng.shutdown()


def test_server_adapter_runs_partial_rollouts_in_the_pipeline_worker(own_fake_server):
    """Asynchronous training on an SGLang server (the fake answers in SGLang's real format; the
    real one: tests/gpu/test_sglang_gpu.py). The pipeline's worker thread generates a batch's
    first segment under the weights of its launch version; after the drain the main thread pushes
    the next version, and the rest of each response continues from prompt + prefix under the new
    weights: exactly the tokens those weights give that context, each token labelled with its
    version."""
    from dataclasses import replace

    from megatron_stare.rollout.async_loop import RolloutPipeline
    from megatron_stare.rollout.partial import SegmentedBatch, segment_seed

    eng = SGLangServerEngine(base_url=own_fake_server, weight_backend="gloo", bucket_bytes=20_000,
                             request_timeout_s=60)
    prompts, params = [[3, 4], [5]], SamplingParams(n=2, max_new_tokens=7, seed=11)

    def advance(job, version):  # one 3-token segment per round
        if job.work is None:
            job.work = SegmentedBatch(prompts, [0, 1], params, 3)
        job.work.advance(eng, version)
        if job.work.finished:
            job.results = job.work.results()
        return job.work.finished

    pipe = RolloutPipeline(1, lambda step: step, advance=advance)
    try:
        eng.update_weights(iter(_named(0)))
        pipe.take(0, 0)
        pipe.launch_ahead(0, 0, end=2)  # step 1's batch starts under version 0, in the worker
        pipe.drain()
        eng.update_weights(iter(_named(1)))  # version 1
        job = pipe.take(1, 1)  # its remaining segments inline, under version 1
        first = eng.generate(prompts, replace(params, max_new_tokens=3))  # under version 1
    finally:
        pipe.close()
    assert job.version == 0 and [(sp.version, sp.step) for sp in job.spans] == [(0, 1), (1, 1), (1, 1)]
    for r, v1 in zip(job.results, first):
        assert r.versions == [0] * 3 + [1] * 4 and len(r.token_ids) == 7
        assert r.token_ids[:3] != v1.token_ids  # the first segment is version 0's
        p = r.prompt_index * params.n + r.sample_index
        cont = eng.generate([prompts[r.prompt_index] + r.token_ids[:3]],
                            replace(params, n=1, max_new_tokens=3, seed=segment_seed(params.seed, 1)),
                            prompt_indices=[p])[0]
        assert r.token_ids[3:6] == cont.token_ids and torch.equal(r.logprobs[3:6], cont.logprobs)
    eng.shutdown()


def test_server_adapter_names_a_dead_server():
    """A server gone mid-request (the connection drops without a reply) or before it (refused):
    one line naming the server and the call, at once."""
    import socket
    import threading

    from megatron_stare.rollout.engines.vllm_server.server import EngineFailure

    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def drop_one():  # reads the whole request, then dies without answering
        conn, _ = listener.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:  # unread bytes at close() would send a reset, not a clean drop
            body += conn.recv(65536)
        conn.close()

    t = threading.Thread(target=drop_one)
    t.start()
    eng = SGLangServerEngine(base_url=url, request_timeout_s=30)
    with pytest.raises(EngineFailure, match=rf"^sglang-server at {url} failed during /generate \((RemoteDisconnected|ConnectionResetError)"):
        eng.generate([[3, 4]], SamplingParams(max_new_tokens=2))
    t.join()
    listener.close()
    with pytest.raises(EngineFailure, match=rf"^sglang-server at {url} failed during /flush_cache \(URLError: "):
        eng._post("/flush_cache")
