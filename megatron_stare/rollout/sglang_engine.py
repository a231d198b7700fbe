"""``sglang`` (colocated ``sglang.Engine``) and ``sglang-server`` (HTTP) adapters. GPU only.

SGLang has no CPU path (its wheels need CUDA and a GPU kernel package), so these adapters are
written against SGLang's documented API and checked here with a recorded fake of it
(``tests/unit/test_rollout_sglang.py``) and on a GPU by ``tests/gpu/test_sglang_gpu.py``.

API used (SGLang ~0.5):
- ``Engine.generate(input_ids=..., sampling_params=..., return_logprob=True)`` -> per row
  ``{"output_ids", "meta_info": {"finish_reason": {"type"}, "output_token_logprobs":
  [(logprob, token_id, text), ...]}}``. Each (prompt, sample) is its own row with its own
  ``sampling_seed``, so ``n`` needs no engine support.
- colocated weights: ``begin_weight_update()``, ``update_weights_from_tensor(named_tensors,
  load_format=None, flush_cache=False)`` once per bucket, ``end_weight_update()``, then
  ``flush_cache()`` (0.5.23 refuses tensor updates outside begin/end; older versions lack them).
- server weights: ``/init_weights_update_group`` (the trainer is rank 0 of a NCCL group named
  ``group_name``), then per bucket ``/update_weights_from_distributed`` with the bucket's
  names/dtypes/shapes while the trainer broadcasts each tensor of the bucket in order.
- memory: ``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)`` (weights
  resumed before the KV cache).

Log-probs: SGLang's ``output_token_logprobs``; they are the raw-logit log-probs this project
uses when sampling at temperature 1 without top-k/top-p (the STARE setting).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..weight_sync.plan import dtype_name, iter_buckets
from .base import GenerationResult, RolloutEngine, SamplingParams, register_engine, sample_seed
from .vllm_server import TRANSPORT_ERRORS, EngineFailure, _free_port

__all__ = ["SGLangEngine", "SGLangServerEngine", "init_named_weight_group", "sglang_rows"]

log = logging.getLogger(__name__)


def sglang_rows(prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams
                ) -> Tuple[List[Tuple[int, int]], List[List[int]], List[dict]]:
    """``(rows, input_ids, sampling_params)``: one SGLang request row per (prompt, sample)."""
    rows = [(p, s) for p in range(len(prompt_token_ids)) for s in range(params.n)]
    sp = []
    for p, s in rows:
        d = {"temperature": params.temperature, "top_p": params.top_p,
             "top_k": params.top_k if params.top_k > 0 else -1,
             "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
             "ignore_eos": params.ignore_eos}
        if params.seed is not None:
            d["sampling_seed"] = sample_seed(sample_seed(params.seed, p), s)
        sp.append(d)
    return rows, [list(prompt_token_ids[p]) for p, _ in rows], sp


def _to_result(row: Tuple[int, int], out: dict) -> GenerationResult:
    meta = out["meta_info"]
    reason = meta["finish_reason"]["type"]
    if reason == "abort":
        raise RuntimeError(f"SGLang aborted a request: {meta['finish_reason']}")
    toks = list(out["output_ids"])
    lps = torch.tensor([float(lp) for lp, _tid, *_ in meta["output_token_logprobs"]], dtype=torch.float32)
    return GenerationResult(row[0], row[1], toks, lps, reason)


@register_engine("sglang")
class SGLangEngine(RolloutEngine):
    """Colocated ``sglang.Engine`` in the trainer's process (GPU).

    Args:
        model_path: HF checkpoint directory.
        bucket_bytes: tensors per ``update_weights_from_tensor`` call.
        engine: an already-built engine object (tests inject a fake); default builds
            ``sglang.Engine(model_path=..., random_seed=seed, skip_tokenizer_init=True,
            enable_memory_saver=True, **engine_kwargs)``.
    """

    def __init__(self, model_path: str, *, seed: int = 0, bucket_bytes: int = 512 << 20,
                 engine=None, **engine_kwargs):
        if engine is None:
            if not torch.cuda.is_available():
                raise ValueError("the sglang engine needs a CUDA GPU (SGLang has no CPU path); "
                                 "use rollout engine 'hf' or 'vllm' on CPU")
            import sglang

            engine_kwargs.setdefault("enable_memory_saver", True)
            engine = sglang.Engine(model_path=str(model_path), random_seed=seed,
                                   skip_tokenizer_init=True, **engine_kwargs)
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self._memory_saver = bool(engine_kwargs.get("enable_memory_saver", True))
        self._asleep = False

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams
                 ) -> List[GenerationResult]:
        rows, input_ids, sp = sglang_rows(prompt_token_ids, params)
        outs = self.engine.generate(input_ids=input_ids, sampling_params=sp, return_logprob=True)
        return [_to_result(r, o) for r, o in zip(rows, outs)]

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        begin = getattr(self.engine, "begin_weight_update", None)
        if begin is not None:
            begin()
        try:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                self.engine.update_weights_from_tensor(named_tensors=bucket, load_format=None,
                                                       flush_cache=False)
        finally:
            if begin is not None:
                self.engine.end_weight_update()
        self.engine.flush_cache()

    @property
    def supports_sleep(self) -> bool:
        return self._memory_saver

    def sleep(self) -> bool:
        if not self.supports_sleep:
            return super().sleep()
        self.engine.release_memory_occupation()
        self._asleep = True
        return True

    def wake_up(self) -> bool:
        if not self._asleep:
            return False
        self.engine.resume_memory_occupation(tags=["weights"])
        self.engine.resume_memory_occupation(tags=["kv_cache"])
        self._asleep = False
        return True

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()


def init_named_weight_group(host: str, port: int, rank: int, world_size: int, group_name: str,
                            backend: str, timeout_s: float = 600.0,
                            register_as: Optional[str] = None) -> dist.ProcessGroup:
    """One member of a named weight-update group formed like SGLang's workers form theirs in
    ``init_weights_update_group``: TCP rendezvous at ``host:port`` (rank 0 hosts the store), a
    prefix store named after the group. The trainer is rank 0. The default group, if any, is
    left untouched. ``register_as``: the local registry name (default ``group_name``; two ends in
    one process, as in tests, need distinct ones)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                      PrefixStore(group_name, store),
                                      group_name=register_as or group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@register_engine("sglang-server")
class SGLangServerEngine(RolloutEngine):
    """An SGLang HTTP server (started elsewhere, e.g. ``python -m sglang.launch_server``).

    Args:
        model_path: unused (the server loaded its model); kept for ``build_engine``.
        base_url: ``http://host:port`` of the server.
        engine_world_size: the server's TP size (its workers join the weight group as 1..W).
        group_host: address of this trainer process reachable from the server.
        weight_backend: ``"nccl"`` on GPUs (``"gloo"`` for CPU tests of the protocol).
        weight_update_session: call ``/begin_weight_update`` / ``/end_weight_update``.
    """

    def __init__(self, model_path: Optional[str] = None, *, base_url: str,
                 engine_world_size: int = 1, group_host: str = "127.0.0.1",
                 group_name: str = "stare_weights", weight_backend: Optional[str] = None,
                 bucket_bytes: int = 512 << 20, weight_update_session: bool = True,
                 request_timeout_s: float = 600.0, max_concurrency: int = 64):
        self.base_url = base_url.rstrip("/")
        self.world = engine_world_size
        self.group_host, self.group_name = group_host, group_name
        self.weight_backend = weight_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.bucket_bytes = bucket_bytes
        self.session = weight_update_session
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._group: Optional[dist.ProcessGroup] = None
        self._asleep = False

    def _post(self, path: str, body: Optional[dict] = None):
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body or {}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"SGLang server {path} failed ({e.code}): "
                               f"{e.read().decode(errors='replace')[:2000]}") from None
        except TRANSPORT_ERRORS as e:
            # Started elsewhere: no pid or log of ours to show; its own log says why.
            detail = str(e).splitlines()[0] if str(e) else ""
            raise EngineFailure(f"sglang-server at {self.base_url} failed during {path} "
                                f"({type(e).__name__}: {detail}): is it still up? See its own log") from None
        out = json.loads(raw) if raw else None
        if isinstance(out, dict) and out.get("success") is False:
            raise RuntimeError(f"SGLang server {path} refused: {out.get('message')}")
        return out

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams
                 ) -> List[GenerationResult]:
        rows, input_ids, sp = sglang_rows(prompt_token_ids, params)

        def one(i: int) -> GenerationResult:
            out = self._post("/generate", {"input_ids": input_ids[i], "sampling_params": sp[i],
                                           "return_logprob": True})
            return _to_result(rows[i], out)

        with ThreadPoolExecutor(max_workers=max(1, min(len(rows), self.max_concurrency))) as pool:
            return list(pool.map(one, range(len(rows))))

    def _in_thread(self, path: str, body: dict) -> Tuple[threading.Thread, dict]:
        box: dict = {}

        def call():
            try:
                box["result"] = self._post(path, body)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                box["error"] = e

        t = threading.Thread(target=call)
        t.start()
        return t, box

    def _ensure_group(self) -> dist.ProcessGroup:
        if self._group is None:
            port = _free_port(self.group_host)
            t, box = self._in_thread("/init_weights_update_group", {
                "master_address": self.group_host, "master_port": port, "rank_offset": 1,
                "world_size": 1 + self.world, "group_name": self.group_name,
                "backend": self.weight_backend})
            try:
                self._group = init_named_weight_group(self.group_host, port, 0, 1 + self.world,
                                                      self.group_name, self.weight_backend,
                                                      self.request_timeout_s)
            finally:
                t.join()
            if "error" in box:
                raise box["error"]
        return self._group

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        group = self._ensure_group()
        device = torch.device("cuda", torch.cuda.current_device()) if self.weight_backend == "nccl" \
            else torch.device("cpu")
        if self.session:
            self._post("/begin_weight_update")
        try:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                t, box = self._in_thread("/update_weights_from_distributed", {
                    "names": [n for n, _ in bucket],
                    "dtypes": [dtype_name(x.dtype) for _, x in bucket],
                    "shapes": [list(x.shape) for _, x in bucket],
                    "group_name": self.group_name, "flush_cache": False})
                try:
                    for _, x in bucket:
                        group.broadcast(x.detach().contiguous().to(device), 0).wait()
                finally:
                    t.join()
                if "error" in box:
                    raise box["error"]
        finally:
            if self.session:
                self._post("/end_weight_update")
        self._post("/flush_cache")

    @property
    def supports_sleep(self) -> bool:
        return True

    def sleep(self) -> bool:
        self._post("/release_memory_occupation", {"tags": None})
        self._asleep = True
        return True

    def wake_up(self) -> bool:
        if not self._asleep:
            return False
        self._post("/resume_memory_occupation", {"tags": ["weights"]})
        self._post("/resume_memory_occupation", {"tags": ["kv_cache"]})
        self._asleep = False
        return True

    def shutdown(self) -> None:
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
