"""Methods injected into every vLLM worker (``worker_extension_cls``), reached by ``collective_rpc``.

vLLM mixes this class into its worker class, so ``self`` is the worker (``self.model_runner``,
``self.reload_weights``, ``self.device``, ...). Method names carry a ``stare_`` prefix so they
never shadow vLLM's own.

Weight updates go through the worker's ``reload_weights(weights_iterator=...)``: vLLM's
layer-wise in-place reload, which buffers the HF pieces of each fused layer (q/k/v -> qkv,
gate/up) until complete, then runs the layer's post-load processing (the CPU backend repacks
linear weights and empties the originals, which is why a plain ``model.load_weights`` after
start-up fails there). The iterator may be lazy: colocated engines pass the trainer's stream,
the server path passes a ``ProcessGroupReceiver`` generator fed by the trainer's broadcasts.

Server calls arrive over HTTP (``/collective_rpc``), where arguments can only be strings:
those methods take JSON strings.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Tuple
from datetime import timedelta

import torch
from torch import Tensor

from megatron_stare.weight_sync import ProcessGroupReceiver, TensorChecksum, tensor_checksum

log = logging.getLogger(__name__)

__all__ = ["StareWorkerExtension"]


def _forget_cpu_moe_kernels(model: torch.nn.Module) -> None:
    """Make vLLM-CPU redo its MoE experts' set-up on a weight reload (a vLLM 0.32 bug otherwise).

    On a weight update vLLM's unquantized MoE method skips the experts' own post-load step
    (``unquantized_fused_moe_method.py:187-205``: ``is_weight_update`` when a kernel exists),
    and on CPU that step is the prepack into the grouped-GEMM layout
    (``experts/cpu_moe.py:208``): reloaded experts would be read in the wrong layout (wrong
    tokens, no error). With the kernel dropped, the reload takes the first-load path: the new
    kernel is built, the experts padded and prepacked, and vLLM's layer-wise reload copies the
    result into the original parameters. Only the kernel object is rebuilt; no GPU path runs
    this (there the kernel must persist: CUDA graphs hold its tensors)."""
    if torch.cuda.is_available():
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None and hasattr(method, "_init_moe_kernel"):
            method.moe_kernel = None


def _tied_cpu_kernels(model: torch.nn.Module) -> Dict[torch.nn.Module, object]:
    """The packed CPU GEMM (``cpu_linear``) of every layer that shares a parameter with another
    layer (a tied LM head), keyed by layer, as it is before a reload.

    Why: vLLM-CPU packs each linear weight into a oneDNN / SGL kernel at load
    (``layers/utils.py``: ``dispatch_cpu_unquantized_gemm``), and a tied head
    (``ParallelLMHead.tie_weights``: ``lm_head.weight = embed_tokens.weight``) packs its own copy
    (``vocab_parallel_embedding.py``: ``UnquantizedEmbeddingMethod.process_weights_after_loading``).
    On a reload only the layer that receives the tensor is processed again
    (``reload/layerwise.py``); the head receives nothing ("ParallelLMHead: Failed to load
    weights"), gets its old parameter object back - which the embedding's reload has refreshed in
    place - but keeps the kernel packed from the old weights: logits from stale weights, no error.
    On GPU the unquantized head reads ``layer.weight`` itself (no pack), so it sees the update."""
    if torch.cuda.is_available():
        return {}
    owners: Dict[int, List[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    return {m: m.cpu_linear for ms in owners.values() if len(ms) > 1 for m in ms
            if getattr(m, "cpu_linear", None) is not None and hasattr(getattr(m, "quant_method", None),
                                                                      "process_weights_after_loading")}


def _repack_stale_kernels(before: Dict[torch.nn.Module, object]) -> int:
    """Re-run the post-load processing (the CPU pack) of each tied layer whose kernel outlived the
    reload (``_tied_cpu_kernels``); returns how many were rebuilt. The layer's weight already
    holds the new values (shared with the layer that was reloaded)."""
    rebuilt = 0
    for module, kernel in before.items():
        if getattr(module, "cpu_linear", None) is kernel:
            module.quant_method.process_weights_after_loading(module)
            rebuilt += 1
    return rebuilt


class _ExpectedReloadWarnings(logging.Filter):
    """vLLM's layer-wise reload warns "<Layer>: Failed to load weights" for every layer that
    received no tensor: a tied head (its weight arrives through the embedding, and
    ``_repack_stale_kernels`` rebuilds its kernel) and parameter-free layers (the rotary
    embedding's cache is a buffer). Those are expected at every sync; any other layer's warning
    (a tensor the sync did not carry) still reaches the console."""

    def __init__(self, expected):
        super().__init__()
        self.expected = set(expected)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.expected)


@contextmanager
def _quiet_expected_reload_warnings(model: torch.nn.Module, tied: Dict[torch.nn.Module, object]):
    expected = {type(m).__name__ for m in tied} | {type(m).__name__ for m in model.modules()
                                                    if not any(True for _ in m.parameters(recurse=False))
                                                    and "Rotary" in type(m).__name__}
    logger, f = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise"), _ExpectedReloadWarnings(expected)
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


class StareWorkerExtension:
    """Weight update, checksum and weight-group methods for a vLLM worker."""

    # ---------------------------------------------------------------- weights
    def stare_reload_weights(self, named_tensors: Iterable[Tuple[str, Tensor]],
                             record_checksums: bool = False) -> Dict[str, float]:
        """Load an HF-named tensor stream in place (vLLM layer-wise reload). Returns counts.

        ``record_checksums``: remember each received tensor's checksum, so ``stare_checksum``
        can answer for parameters that cannot be read back (repacked, fused, TP-sharded).
        """
        received: Dict[str, TensorChecksum] = getattr(self, "_stare_received", {})
        counts = {"tensors": 0, "bytes": 0}

        def stream():
            for name, t in named_tensors:
                counts["tensors"] += 1
                counts["bytes"] += t.numel() * t.element_size()
                if record_checksums:
                    received[name] = tensor_checksum(t, source="received")
                yield name, t

        model = self.model_runner.get_model()
        _forget_cpu_moe_kernels(model)
        tied = _tied_cpu_kernels(model)
        with _quiet_expected_reload_warnings(model, tied):
            self.reload_weights(weights_iterator=stream())
        counts["repacked_tied"] = _repack_stale_kernels(tied)
        self._stare_received = received
        return counts

    # ---------------------------------------------------------------- server: weight group
    def stare_init_weight_group(self, spec: str) -> int:
        """Join the trainer's weight-broadcast group. ``spec`` is JSON with ``host``, ``port``,
        ``world_size``, ``rank_offset``, ``backend`` ("gloo"|"nccl"), ``timeout_s``.
        This worker's rank in that group is ``rank_offset`` + its rank in the engine."""

        from vllm.distributed.parallel_state import get_world_group
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        s = json.loads(spec)
        rank = s["rank_offset"] + get_world_group().rank_in_group
        self._stare_group = stateless_init_torch_distributed_process_group(
            s["host"], s["port"], rank, s["world_size"], s["backend"],
            timeout=timedelta(seconds=s.get("timeout_s", 600)))
        self._stare_receiver = ProcessGroupReceiver(
            self._stare_group, root=0, device=self.device if s["backend"] == "nccl" else torch.device("cpu"))
        log.info("joined weight group %s:%s as rank %d of %d (%s)", s["host"], s["port"], rank,
                 s["world_size"], s["backend"])
        return rank

    def stare_receive_weights(self, opts: str = "{}") -> Dict[str, float]:
        """Receive the trainer's bucket broadcast (group rank 0) and reload from it."""
        if getattr(self, "_stare_group", None) is None:
            raise RuntimeError("no weight group: call stare_init_weight_group first")
        o = json.loads(opts)
        recv = self._stare_receiver  # kept across syncs: its staging buffer is reused
        counts = self.stare_reload_weights(recv.receive(), bool(o.get("record_checksums", False)))
        counts.update(buckets=recv.stats.num_buckets, seconds=recv.stats.seconds)
        return counts

    def stare_destroy_weight_group(self) -> bool:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        group = getattr(self, "_stare_group", None)
        if group is None:
            return False
        stateless_destroy_torch_distributed_process_group(group)
        self._stare_group = self._stare_receiver = None
        return True

    # ---------------------------------------------------------------- checksums
    def stare_checksum(self, names) -> Dict[str, Optional[dict]]:
        """``{hf_name: TensorChecksum-as-dict or None}``; ``names`` a list or a JSON list.

        Reads the live parameter when vLLM keeps it under the HF name, unsharded and not
        repacked (embeddings with vocab padding trimmed, norms, ...); otherwise the checksum
        recorded at load time (``source="received"``) when recording was on; else None.
        """
        if isinstance(names, str):
            names = json.loads(names)
        from vllm.distributed import get_tensor_model_parallel_world_size

        params = dict(self.model_runner.get_model().named_parameters())
        received: Dict[str, TensorChecksum] = getattr(self, "_stare_received", {})
        tp = get_tensor_model_parallel_world_size()
        vocab = self.model_runner.model_config.hf_config.vocab_size
        out: Dict[str, Optional[dict]] = {}
        for name in names:
            rec = received.get(name)
            p = params.get(name)
            live = None
            if p is not None and p.numel() > 0:
                if p.dim() >= 1 and ("embed_tokens" in name or "lm_head" in name):
                    p = p[:vocab]
                shape_ok = tuple(p.shape) == tuple(rec.shape) if rec is not None else tp == 1
                if shape_ok:
                    live = tensor_checksum(p)
            chosen = live or rec
            out[name] = None if chosen is None else chosen.to_json()
        return out

    def stare_engine_info(self) -> Dict[str, object]:
        """What this worker runs with, for the trainer's check that an attached server honours
        the run's spec: dtype (``float32``/``bfloat16``), ``max_model_len``, ``logprobs_mode``."""
        mc = self.model_runner.model_config
        return {"dtype": str(mc.dtype).removeprefix("torch."), "max_model_len": int(mc.max_model_len),
                "logprobs_mode": str(mc.logprobs_mode)}

    def stare_param_names(self) -> List[str]:
        """vLLM's own parameter names (fused, engine-side), for diagnostics."""
        return [n for n, _ in self.model_runner.get_model().named_parameters()]
