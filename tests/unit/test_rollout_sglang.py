"""SGLang adapters against a recorded fake of SGLang's API (SGLang cannot run on CPU).

The fakes enforce the protocol SGLang enforces: tensor updates only inside
``begin_weight_update`` / ``end_weight_update`` (as 0.5.23 does), caches flushed after the
update, weights resumed before the KV cache. The server fake is a real HTTP server on
127.0.0.1 whose ``/init_weights_update_group`` joins a real gloo group with the trainer and
whose ``/update_weights_from_distributed`` receives the trainer's broadcasts.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_stare.rollout import SamplingParams, build_engine
from megatron_stare.rollout.sglang_engine import SGLangEngine, SGLangServerEngine, init_named_weight_group
from megatron_stare.weight_sync.plan import dtype_from_name


def _named(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(64, 32, generator=g)) for i in range(4)] + [
        ("model.norm.weight", torch.randn(32, generator=g).to(torch.bfloat16))]


class FakeSGLang:
    """Records calls; refuses what SGLang refuses; 'generates' from the weights it holds."""

    def __init__(self):
        self.calls, self.weights, self.in_update, self.dirty = [], {}, False, False
        self.released = set()

    def begin_weight_update(self):
        assert not self.in_update, "weight update session already open"
        self.calls.append(("begin",))
        self.in_update = True

    def end_weight_update(self):
        assert self.in_update, "no weight update session open"
        self.calls.append(("end",))
        self.in_update = False

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if not self.in_update:
            raise RuntimeError("update_weights_from_tensor refused outside begin/end_weight_update")
        assert load_format is None
        self.calls.append(("tensor", [n for n, _ in named_tensors], flush_cache))
        self.weights.update((n, t.clone()) for n, t in named_tensors)
        self.dirty = True

    def flush_cache(self):
        self.calls.append(("flush",))
        self.dirty = False

    def generate(self, input_ids, sampling_params, return_logprob):
        assert return_logprob and not self.dirty and not self.released, "stale cache / asleep"
        self.calls.append(("generate", len(input_ids)))
        return [fake_generation(ids, sp, self.weights) for ids, sp in zip(input_ids, sampling_params)]

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))
        self.released = {"weights", "kv_cache"}

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))
        assert tags != ["kv_cache"] or "weights" not in self.released, "KV cache resumed before weights"
        self.released -= set(tags or ["weights", "kv_cache"])

    def shutdown(self):
        self.calls.append(("shutdown",))


def fake_generation(ids, sp, weights):
    """A deterministic function of the prompt, sampling params and weights, in SGLang's format."""
    w = sum(float(t.double().sum()) for t in weights.values())
    base = int(abs(w) * 1000) + sum(ids) + sp.get("sampling_seed", 0)
    out = [(base + i) % 97 for i in range(sp["max_new_tokens"])]
    stop = set(sp["stop_token_ids"])
    cut = next((i + 1 for i, t in enumerate(out) if t in stop), len(out))
    reason = "stop" if cut < len(out) or (out and out[cut - 1] in stop) else "length"
    out = out[:cut]
    return {"output_ids": out, "meta_info": {
        "finish_reason": {"type": reason},
        "output_token_logprobs": [(-0.5 - 0.01 * t, t, None) for t in out]}}


def test_colocated_update_protocol_and_results():
    fake = FakeSGLang()
    eng = build_engine("sglang", "unused", engine=fake, bucket_bytes=20_000)
    eng.update_weights(iter(_named(0)))
    kinds = [c[0] for c in fake.calls]
    assert kinds[0] == "begin" and kinds[-2:] == ["end", "flush"]
    tensor_calls = [c for c in fake.calls if c[0] == "tensor"]
    assert len(tensor_calls) > 1  # bucketed
    assert all(flush is False for *_, flush in tensor_calls)  # one flush, after the whole update
    assert sorted(fake.weights) == sorted(n for n, _ in _named(0))
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=4)
    res = eng.generate([[1, 2, 3], [4, 5]], params)
    assert [(r.prompt_index, r.sample_index) for r in res] == [(p, s) for p in range(2) for s in range(3)]
    assert len({tuple(r.token_ids) for r in res[:3]}) == 3  # distinct per-sample seeds
    assert res[0].logprobs.dtype == torch.float32 and res[0].finish_reason == "length"
    assert eng.generate([[1, 2, 3], [4, 5]], params)[0].token_ids == res[0].token_ids
    stop = res[0].token_ids[1]
    r = eng.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=5, seed=4,
                                                 stop_token_ids=(stop,)))[0]
    assert r.token_ids == res[0].token_ids[:2] and r.finish_reason == "stop"


def test_colocated_update_closes_the_session_on_error():
    fake = FakeSGLang()
    eng = SGLangEngine("unused", engine=fake)

    def broken():
        yield _named(0)[0]
        raise OSError("export failed")

    with pytest.raises(OSError):
        eng.update_weights(broken())
    assert fake.in_update is False and fake.calls[-1] == ("end",)


def test_colocated_sleep_resumes_weights_first():
    fake = FakeSGLang()
    eng = SGLangEngine("unused", engine=fake)
    assert eng.supports_sleep and eng.sleep()
    assert eng.wake_up()
    assert [c for c in fake.calls if c[0] in ("release", "resume")] == [
        ("release", None), ("resume", ["weights"]), ("resume", ["kv_cache"])]
    eng.shutdown()
    assert fake.calls[-1] == ("shutdown",)


def test_real_sglang_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    with pytest.raises(ValueError, match="CUDA"):
        SGLangEngine("some/model")


# ---------------------------------------------------------------------------- server fake
class _FakeServerState:
    """The fake SGLang server's state; runs in its own process (a gloo group cannot be formed
    by two threads of one process: the backend's constructor holds the GIL)."""

    def __init__(self):
        self.calls, self.weights, self.in_update, self.group = [], {}, False, None

    def handle(self, path, b):
        if path == "/_inspect":  # test-only: what the server holds
            return {"calls": self.calls, "weights": {n: [t.double().sum().item(), str(t.dtype),
                                                         list(t.shape)] for n, t in self.weights.items()}}
        self.calls.append(path)
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


def _serve_fake(queue):
    state = _FakeServerState()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            try:
                out, code = state.handle(self.path, body), 200
            except Exception as e:  # noqa: BLE001
                out, code = {"success": False, "message": repr(e)}, 400
            data = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    queue.put(f"http://127.0.0.1:{httpd.server_address[1]}")
    httpd.serve_forever()


@pytest.fixture
def fake_server():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve_fake, args=(q,), daemon=True)
    proc.start()
    try:
        yield q.get(timeout=60)
    finally:
        proc.kill()
        proc.join()


def test_server_adapter_distributed_update_over_gloo(fake_server):
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




def test_server_adapter_names_a_dead_server():
    """A server gone mid-request (the connection drops without a reply) or before it (refused):
    one line naming the server and the call, at once."""
    import socket
    import threading

    from megatron_stare.rollout.vllm_server import EngineFailure

    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def drop_one():  # reads the request, then dies without answering
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()

    t = threading.Thread(target=drop_one)
    t.start()
    eng = SGLangServerEngine(base_url=url, request_timeout_s=30)
    with pytest.raises(EngineFailure, match=rf"^sglang-server at {url} failed during /generate \(RemoteDisconnected"):
        eng.generate([[3, 4]], SamplingParams(max_new_tokens=2))
    t.join()
    listener.close()
    with pytest.raises(EngineFailure, match=rf"^sglang-server at {url} failed during /flush_cache \(URLError: "):
        eng._post("/flush_cache")
