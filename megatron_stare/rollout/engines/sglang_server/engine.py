"""``sglang-server``: an SGLang HTTP server started elsewhere, on GPUs of its own. GPU only.

The trainer attaches to ``rollout.server_urls[0]``; ``server_command(spec)`` is the command a
launch script starts it with (``python -m megatron_stare.rollout.server_cmd`` prints it):
``python -m sglang.launch_server`` with the spec's ``--tp-size``, ``--dtype``,
``--context-length``, ``--mem-fraction-static``, ``--random-seed`` and
``--skip-tokenizer-init`` (flag names checked against SGLang 0.5.23's ``ServerArgs``), and
``SGLANG_RETURN_ORIGINAL_LOGPROB=false`` (the log-prob convention). Attaching reads the
server's ``/server_info`` and fails in one line when its TP size, dtype or context length do
not match the run.

Weights: ``/init_weights_update_group`` (the trainer is rank 0 of a group named
``group_name``), then per bucket ``/update_weights_from_distributed`` with the bucket's
names/dtypes/shapes while the trainer broadcasts each tensor of the bucket in order, inside
``/begin_weight_update`` ... ``/end_weight_update``, then ``/flush_cache`` (SGLang's protocol, not
ours: its server decides it; the group, the threads and the sends come from ``weight_sync``).
Every weight route answers ``{"success", "message"}`` (status 400 on failure: raised);
``/flush_cache`` answers in plain text.

Seeds: each request carries its ``sampling_seed``, but SGLang 0.5.23 uses it only with
``--enable-deterministic-inference`` (``srt/sampling/sampling_batch_info.py``, the
``sampling_seed`` tensor is built only then): without it, sampling is not reproducible and a
resumed run does not regenerate the interrupted step's samples. The engine says so once
(``SEED_NOTICE``); deterministic inference (batch-invariant kernels) is the user's choice of
server flags, at its cost in speed.

The colocated ``sglang`` engine (``engines/sglang/engine.py``) is this client against a server it
spawns on its TP group's GPUs.

Memory: the server is not on the trainer's GPUs, so the release phase has nothing to free
(it says so once).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_stare.weight_sync import (PeerCalls, dtype_name, form_group, group_link, init_named_weight_group,
                                        iter_buckets, route_address, send_each)
from megatron_stare.errors import UserError
from megatron_stare.rollout.base import (GenerationResult, MemoryRelease, RolloutEngine, SamplingParams, batch_indices, sample_seed)
from megatron_stare.rollout.http import EngineFailure, request_json
from megatron_stare.rollout.routed_experts import MoELayout, decode_sglang, moe_layout, to_result_layout
from megatron_stare.rollout.interruptible import run_requests
from megatron_stare.rollout.spec import EngineSpec
from megatron_stare.rollout.spawned import ServerCommand

__all__ = ["RAW_LOGPROB_ENV", "SEED_NOTICE", "SGLangServerEngine", "check_logprob_env", "moe_kwargs",
           "server_command", "sglang_rows", "to_result"]

log = logging.getLogger(__name__)

RAW_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
"""SGLang's switch to raw-logit log-probs (read by its sampler); must stay off."""
SEED_NOTICE = ("SGLang ignores per-request sampling seeds unless the server runs with "
               "--enable-deterministic-inference (sglang srt/sampling/sampling_batch_info.py): rollouts are not "
               "reproducible, and a resumed run does not regenerate the samples of the interrupted step")
"""Said once per engine: what ``SamplingParams.seed`` does not give on SGLang (vLLM honours it)."""


def moe_kwargs(spec: EngineSpec) -> dict:
    """A mixture-of-experts policy: SGLang's expert parallel over the engine's TP group
    (``ep_size = tp_size``: each GPU holds whole experts, 1/tp of them, instead of a 1/tp slice
    of every expert), and ``enable_return_routed_experts`` when the spec asks for the routing
    (``return_routed_experts``: routing replay). Nothing for a dense model."""
    local = Path(spec.model_path) / "config.json"
    if not local.is_file():  # a server command printed for another node: its flags are the user's
        return {}
    if moe_layout(spec.model_path) is None:
        if spec.return_routed_experts:
            raise UserError(f"return_routed_experts: {spec.model_path} is not a mixture-of-experts model")
        return {}
    kw = {"ep_size": spec.tp}
    if spec.return_routed_experts:
        kw["enable_return_routed_experts"] = True
    return kw


def check_logprob_env(env=os.environ) -> None:
    """SGLang must return log-probs after temperature: refuse a raw-log-prob switch."""
    if env.get(RAW_LOGPROB_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        raise UserError(f"{RAW_LOGPROB_ENV} is set: SGLang would return raw-logit log-probs, not the "
                        f"temperature-scaled ones the trainer computes; unset it")


def sglang_rows(prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                prompt_indices: Optional[Sequence[int]] = None
                ) -> Tuple[List[Tuple[int, int]], List[List[int]], List[dict]]:
    """``(rows, input_ids, sampling_params)``: one SGLang request row per (prompt, sample); a
    row is ``(batch index of the prompt, sample index)`` (see ``RolloutEngine.generate``). Each
    row carries its own ``sampling_seed``, which SGLang honours only in deterministic mode
    (``SEED_NOTICE``)."""
    idx = batch_indices(prompt_token_ids, prompt_indices)
    local = {g: p for p, g in enumerate(idx)}
    rows = [(g, s) for g in idx for s in range(params.n)]
    sp = []
    for p, s in rows:
        d = {"temperature": params.temperature, "top_p": params.top_p,
             "top_k": params.top_k if params.top_k > 0 else -1,
             "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
             "ignore_eos": params.ignore_eos}
        if params.seed is not None:
            d["sampling_seed"] = sample_seed(sample_seed(params.seed, p), s)
        sp.append(d)
    return rows, [list(prompt_token_ids[local[p]]) for p, _ in rows], sp


def to_result(row: Tuple[int, int], out: dict, moe: Optional[MoELayout] = None) -> GenerationResult:
    """One SGLang output row -> our result; ``moe``: read its routed experts too."""
    meta = out["meta_info"]
    reason = meta["finish_reason"]["type"]
    if reason == "abort":
        raise RuntimeError(f"SGLang aborted a request: {meta['finish_reason']}")
    toks = list(out["output_ids"])
    lps = torch.tensor([float(lp) for lp, _tid, *_ in meta["output_token_logprobs"]], dtype=torch.float32)
    routed = None
    if moe is not None:
        if meta.get("routed_experts") is None:
            raise RuntimeError("SGLang returned no routed experts (start it with enable_return_routed_experts)")
        routed = to_result_layout(decode_sglang(meta["routed_experts"], moe), moe.layers)
    return GenerationResult(row[0], row[1], toks, lps, reason, routed_experts=routed)


def server_command(spec: EngineSpec, host: str = "0.0.0.0", port: int = 30000) -> ServerCommand:
    """The spec as ``sglang.launch_server`` flags (SGLang 0.5.23's names)."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model_path,
            "--host", host, "--port", str(port), "--tp-size", str(spec.tp), "--dtype", spec.dtype,
            "--context-length", str(spec.context_length),
            "--mem-fraction-static", str(spec.gpu_memory_utilization),
            "--random-seed", str(spec.seed), "--skip-tokenizer-init"]
    moe = moe_kwargs(spec)  # a mixture-of-experts policy: expert parallel, routing when asked
    if "ep_size" in moe:
        argv += ["--ep-size", str(moe["ep_size"])]
    if moe.get("enable_return_routed_experts"):
        argv.append("--enable-return-routed-experts")
    return ServerCommand(tuple(argv), {RAW_LOGPROB_ENV: "false"})


class SGLangServerEngine(RolloutEngine):
    """An SGLang HTTP server started elsewhere (``server_command``), driven over HTTP.

    Args:
        base_url: ``http://host:port`` of the server.
        engine_world_size: the server's TP size (its workers join the weight group as 1..W).
        expect: what the server must report in ``/server_info`` (``tp_size``, ``dtype``,
            ``context_length``; the last as a minimum); empty: no check.
        group_host: address of this trainer process reachable from the server (default: the
            address this machine routes to the server from).
        weight_backend: ``"nccl"`` on GPUs (``"gloo"`` for CPU tests of the protocol).
        return_routed_experts / model_path: results carry the server's routed experts (the
            server runs with ``--enable-return-routed-experts``, which ``server_command`` adds
            when the spec asks); ``model_path``: the checkpoint whose MoE layers they cover.
    """

    name = "sglang-server"

    def __init__(self, *, base_url: str, engine_world_size: int = 1, expect: Optional[dict] = None,
                 group_host: Optional[str] = None, group_name: str = "stare_weights",
                 weight_backend: Optional[str] = None, bucket_bytes: int = 512 << 20,
                 request_timeout_s: float = 600.0, max_concurrency: int = 64,
                 return_routed_experts: bool = False, model_path: Optional[str] = None):
        if return_routed_experts and (model_path is None or moe_layout(model_path) is None):
            raise UserError(f"sglang-server: return_routed_experts needs the mixture-of-experts checkpoint's "
                             f"model_path (got {model_path})")
        self._moe = moe_layout(model_path) if return_routed_experts else None
        self.base_url = base_url.rstrip("/")
        self.world = engine_world_size
        self.group_host = group_host or route_address(self.base_url)
        self.group_name = group_name
        self.weight_backend = weight_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.bucket_bytes = bucket_bytes
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._group: Optional[dist.ProcessGroup] = None
        self.say_once(SEED_NOTICE)
        if expect:
            self._check_server(expect)

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "SGLangServerEngine":
        return cls(base_url=spec.server_urls[0], engine_world_size=spec.tp,
                   expect={"tp_size": spec.tp, "dtype": spec.dtype, "context_length": spec.context_length},
                   weight_backend="nccl" if spec.cuda else "gloo", bucket_bytes=spec.sync_bucket_bytes,
                   return_routed_experts=spec.return_routed_experts, model_path=spec.model_path)

    def _check_server(self, expect: dict) -> None:
        """The server must honour the spec; one line naming every difference otherwise."""
        info = self._get("/server_info")
        bad = [k for k, v in expect.items()
               if ((info.get(k) or 0) < v if k == "context_length" else info.get(k) != v)]
        if bad:
            cmd = "python -m megatron_stare.rollout.server_cmd"
            raise UserError(f"sglang-server at {self.base_url} does not match the run: "
                             + ", ".join(f"{k} {info.get(k)!r} (the run needs {expect[k]!r})" for k in bad)
                             + f"; start it with the command `{cmd}` prints")

    def _get(self, path: str):
        return request_json(self.base_url + path, None, method="GET", timeout=self.request_timeout_s,
                            server="SGLang server", failure=self._failure)

    def _failure(self, path: str, e: BaseException) -> EngineFailure:
        # Started elsewhere: no pid or log of ours to show; its own log says why.
        detail = str(e).splitlines()[0] if str(e) else ""
        return EngineFailure(f"sglang-server at {self.base_url} failed during {path} "
                             f"({type(e).__name__}: {detail}): is it still up? See its own log")

    def _post(self, path: str, body: Optional[dict] = None, text: bool = False):
        """POST ``path``; the decoded reply. A reply ``{"success": false}`` (SGLang's weight and
        memory routes answer so, with status 400, when they fail) raises."""
        out = request_json(self.base_url + path, body or {}, method="POST", timeout=self.request_timeout_s,
                           server="SGLang server", failure=self._failure, text=text)
        if isinstance(out, dict) and out.get("success") is False:
            raise RuntimeError(f"SGLang server {path} refused: {out.get('message')}")
        return out

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompt_indices: Optional[Sequence[int]] = None) -> List[GenerationResult]:
        self.check_can_generate()
        rows, input_ids, sp = sglang_rows(prompt_token_ids, params, prompt_indices)

        def one(i: int) -> GenerationResult:
            body = {"input_ids": input_ids[i], "sampling_params": sp[i], "return_logprob": True}
            if self._moe is not None:
                body["return_routed_experts"] = True
            return to_result(rows[i], self._post("/generate", body), self._moe)

        return run_requests(len(rows), one, max_workers=self.max_concurrency, interrupted=self.interrupted,
                            abort=self.abort_requests)

    def abort_requests(self) -> None:
        """End every request in flight (a preemption: ``rollout/interruptible.py``)."""
        self._post("/abort_request", {"rid": "", "abort_all": True})

    def _ensure_group(self) -> dist.ProcessGroup:
        if self._group is None:
            def join(port: int) -> None:
                self._post("/init_weights_update_group", {
                    "master_address": self.group_host, "master_port": port, "rank_offset": 1,
                    "world_size": 1 + self.world, "group_name": self.group_name,
                    "backend": self.weight_backend})

            self._group = form_group([join], lambda port, sock: init_named_weight_group(
                self.group_host, port, 0, 1 + self.world, self.group_name, self.weight_backend,
                self.request_timeout_s, listen_socket=sock), self.group_host)
        return self._group

    def update_weights(self, named_tensors: Iterable[Tuple[str, Tensor]]) -> None:
        """SGLang's own wire format (its server decides it): per bucket, the names/dtypes/shapes
        over HTTP, then one broadcast per tensor in order (``weight_sync.iter_buckets`` groups)."""
        self.check_can_load_weights()
        group = self._ensure_group()
        device = torch.device("cuda", torch.cuda.current_device()) if self.weight_backend == "nccl" \
            else torch.device("cpu")
        self._post("/begin_weight_update")
        try:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                calls = PeerCalls([lambda b=bucket: self._post("/update_weights_from_distributed", {
                    "names": [n for n, _ in b],
                    "dtypes": [dtype_name(x.dtype) for _, x in b],
                    "shapes": [list(x.shape) for _, x in b],
                    "group_name": self.group_name, "flush_cache": False})])
                try:
                    send_each(group_link(group, 0), (x for _, x in bucket), device)
                finally:
                    errors = calls.join()
                if errors:
                    raise errors[0]
        finally:
            self._post("/end_weight_update")
        self.flush_cache()

    def flush_cache(self) -> None:
        """Drop the radix (prefix) cache. SGLang answers this route in plain text, not JSON
        (``srt/entrypoints/http_server.py`` ``flush_cache``), with status 400 if it refused."""
        self._post("/flush_cache", text=True)

    @property
    def memory_release(self) -> MemoryRelease:
        return MemoryRelease(False, "the server runs on GPUs of its own; nothing to release there")

    def shutdown(self) -> None:
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
