"""Make megatron-core run on a CPU-only machine (gloo), for tests and the CPU demo.

megatron-core assumes CUDA in a handful of places. ``apply()`` patches exactly those, and only
when ``torch.cuda.is_available()`` is False; on a GPU machine it does nothing. Every patch is
idempotent and tolerant of the megatron-core versions we support (0.16 through 0.19): a
module or attribute that a version lacks is skipped, never an error. The patches, as
measured in ``shared/docs/cpu-recipe.md``:

1. ``torch.cuda.current_device`` -> ``"cpu"``. Megatron allocates buffers with
   ``device=torch.cuda.current_device()`` in dozens of places (layers, p2p, DDP buffers);
   answering "cpu" makes all of them CPU tensors without touching those call sites.
2. The CUDA RNG tracker -> ``CPURNGStatesTracker``. Attention and weight init fork the
   tracker's named states (``model-parallel-rng`` ...) even with dropout 0. On CPU the only
   generator is the default CPU one, so each named state is a saved CPU generator state that
   ``fork(name)`` swaps in and out, with the same per-name semantics as the CUDA tracker.
   Megatron's own ``_get/_set_cuda_rng_state`` (used by activation recompute) are pointed at
   the CPU generator too.
3. Hard-coded ``device="cuda"`` tensor factories inside a few modules (pipeline schedules,
   optimizer, clip_grads, grad buffers, utils, the causal-mask helper) are redirected by
   giving those modules a view of ``torch`` whose factories map a CUDA device to CPU. This is
   local to those modules and 1.5-2x faster than a process-wide ``TorchFunctionMode``.
4. ``clip_grad_by_total_norm_fp32`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``; it
   is replaced (in ``clip_grads`` and in the optimizer module that imported it) by the same
   in-place scaling without the type-string assertion.
5. ``torch.cuda.synchronize`` (called after pipeline p2p) becomes a no-op.
6. ``torch.cuda.current_stream`` / ``default_stream`` / ``Stream`` (newer DDP) return a
   do-nothing stream object.
7. ``Tensor.cuda()`` returns the tensor itself: megatron-core calls ``weight.data.cuda()`` when
   it ties the embedding of the first and last pipeline stage
   (``LanguageModule.setup_embeddings_and_output_layer``); on CPU "the current device" is CPU.
8. ``optimizer_type_checks``: the constructors of ``DistributedOptimizer`` and of the bf16/fp16
   ``Float16OptimizerWithFloat16Params`` sort parameters into fp32 and 16-bit groups by their
   type string and reject anything but ``torch.cuda.{Float,Half,BFloat16}Tensor``. While those
   two constructors run (and only then), ``Parameter.type()`` reports a CPU parameter with the
   CUDA spelling of its own dtype, so the sorting is the one CUDA would do.
9. ``moe_te_gemm``: megatron's ``moe_utils`` names ``te_general_gemm`` only when
   transformer-engine imports, yet the router's gating linear tests it for None
   (``RouterGatingLinearFunction``: a NameError without TE); it is defined as None, so the
   router falls back to ``torch.mm``.
10. ``moe_split_sizes``: the alltoall token dispatcher turns its split sizes into numpy arrays
   with ``maybe_move_tensor_to_cpu``, which converts CUDA tensors only; gloo's
   ``all_to_all_single`` refuses tensors as split sizes. The dispatcher's copy converts CPU
   tensors as well. (Its ``torch.cuda.Stream()`` and the event it synchronises on are patch 6:
   ``_NullStream.record_event`` returns an event that has always happened.)
11. ``uneven_gather``: megatron's ``_gather_along_first_dim`` with unequal ``output_split_sizes``
   (the dispatcher at TP x ETP > 1) all-gathers a list of unequal tensors, which gloo refuses;
   on CPU it pads each rank's rows to the largest count, gathers once and cuts the padding.

With these, the distributed optimizer and bf16 params with fp32 main params run on CPU gloo
ranks. Sequence parallel needs no patch here: its blocker is Megatron's torch norm, which does
not mark its weights for the TP gradient all-reduce; our layer spec uses a norm that does
(``models/layer_specs.py``). Context parallel and packed sequences need no patch here beyond
RoPE's chunk index (patch 3): megatron-core's local ``DotProductAttention`` refuses both, and
the local spec uses ``models/torch_attention.py`` instead.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Dict, List

import torch

_APPLIED: Dict[str, bool] = {}
_SKIPPED: set = set()  # patches left out on purpose (tests only); later apply() calls honour it

#: Modules whose module-level ``torch`` gets the CPU view (patch 3).
CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    # RoPE under context parallel: ``get_pos_emb_on_this_cp_rank`` builds its chunk index
    # with ``pin_memory=True`` (refused without CUDA) and moves it with ``.cuda()`` (patch 7).
    "megatron.core.models.common.embeddings.rope_utils",
)

_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like",
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare int means a CUDA ordinal


class _CpuTorchView:
    """Stands in for ``torch`` inside one Megatron module: CUDA factories land on CPU."""

    def __init__(self) -> None:
        for name in _FACTORIES:
            setattr(self, name, self._wrap(getattr(torch, name)))

    @staticmethod
    def _wrap(fn):
        def factory(*args, **kwargs):
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        factory.__wrapped__ = fn
        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _NullEvent:
    """What ``_NullStream.record_event`` returns: an event that has always happened (the
    MoE alltoall dispatcher synchronises on the event of its device-to-host stream)."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """A do-nothing stand-in for ``torch.cuda.Stream`` on CPU (patch 6)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_NULL_STREAM = _NullStream()


def _cpu_rng_state_get(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_state_set(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class(base):
    class CPURNGStatesTracker(base):
        """Megatron's RNG tracker with named states kept as CPU generator states (patch 2)."""

        def __init__(self, *args, **kwargs) -> None:
            kwargs.pop("use_cudagraphable_rng", None)
            kwargs.pop("is_inference_rng_tracker", None)
            self.use_cudagraphable_rng = False
            self.is_inference_rng_tracker = False
            self.reset()

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CPURNGStatesTracker


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's ``clip_grad_by_total_norm_fp32`` without the CUDA type-string assert (patch 4)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for p in parameters:
        g = getattr(p, attr, None)
        if g is not None:
            if g.dtype != torch.float32 and not use_decoupled_grad:
                raise TypeError(f"expected fp32 gradients for clipping, got {g.dtype}")
            grads.append(g.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"


def _patch_synchronize() -> None:
    torch.cuda.synchronize = lambda *a, **k: None


def _patch_streams() -> None:
    torch.cuda.current_stream = lambda *a, **k: _NULL_STREAM
    torch.cuda.default_stream = lambda *a, **k: _NULL_STREAM
    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _patch_tensor_cuda() -> None:
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    if not getattr(mrandom.CudaRNGStatesTracker, "_megatron_stare_cpu", False):
        cls = _make_cpu_tracker_class(mrandom.CudaRNGStatesTracker)
        cls._megatron_stare_cpu = True
        mrandom.CudaRNGStatesTracker = cls
    mrandom._get_cuda_rng_state = _cpu_rng_state_get
    mrandom._set_cuda_rng_state = _cpu_rng_state_set
    # A tracker built before the patch would be a CUDA one: drop it so the next use rebuilds.
    tracker = getattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    if tracker is not None and not isinstance(tracker, mrandom.CudaRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _patch_factories() -> List[str]:
    view = _CpuTorchView()
    patched = []
    for name in CUDA_FACTORY_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = view
            patched.append(name)
    return patched


def _patch_clip_grads() -> None:
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer",
                 "megatron.core.optimizer.distrib_optimizer"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "clip_grad_by_total_norm_fp32"):
            mod.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32


def _cuda_type_string(self, dtype=None, non_blocking: bool = False, **kwargs):
    """``Parameter.type()`` as the optimizers' constructors see it on CPU (patch 8): the CUDA
    spelling of a CPU parameter's own type; any conversion call is torch's own."""
    if dtype is None and not kwargs and self.device.type == "cpu":
        return torch.Tensor.type(self).replace("torch.", "torch.cuda.", 1)
    return torch.Tensor.type(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _params_report_cuda_types():
    had = "type" in vars(torch.nn.Parameter)
    saved = vars(torch.nn.Parameter).get("type")
    torch.nn.Parameter.type = _cuda_type_string
    try:
        yield
    finally:
        if had:
            torch.nn.Parameter.type = saved
        else:
            del torch.nn.Parameter.type


def _reporting_cuda_types(init):
    def __init__(self, *args, **kwargs):
        with _params_report_cuda_types():
            init(self, *args, **kwargs)

    __init__.__wrapped__ = init
    __init__._megatron_stare_cpu = True
    return __init__


def _patch_optimizer_type_checks() -> None:
    targets = (("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
               ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"))
    for module, name in targets:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if not getattr(cls.__init__, "_megatron_stare_cpu", False):
            cls.__init__ = _reporting_cuda_types(cls.__init__)


def _patch_moe_te_gemm() -> None:
    try:
        mod = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    except ImportError:
        return
    if not hasattr(mod, "te_general_gemm"):
        mod.te_general_gemm = None


def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors already on CPU (patch 10): the
    numpy conversion it applies only to CUDA tensors is what gloo's ``all_to_all_single``
    needs for its split sizes (it refuses tensors there)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _patch_moe_split_sizes() -> None:
    try:
        mod = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    except ImportError:
        return
    if hasattr(mod, "maybe_move_tensor_to_cpu"):
        mod.maybe_move_tensor_to_cpu = _cpu_maybe_move_tensor_to_cpu


def _uneven_gather(original):
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        """megatron's ``_gather_along_first_dim`` where gloo's ``all_gather`` of a list of
        unequal tensors fails (patch 11): each rank's rows padded to the largest count, one
        equal all-gather, the padding cut away."""
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if group is None or group.size() == 1 or sizes is None or len(set(sizes)) == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        most = max(sizes)
        padded = input_.new_zeros((most,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * len(sizes),) + tuple(input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(out.split(most), sizes)])

    gather.__wrapped__ = original
    gather._megatron_stare_cpu = True
    return gather


def _patch_uneven_gather() -> None:
    mod = importlib.import_module("megatron.core.tensor_parallel.mappings")
    if not getattr(mod._gather_along_first_dim, "_megatron_stare_cpu", False):
        mod._gather_along_first_dim = _uneven_gather(mod._gather_along_first_dim)


#: The patches by name, in the order of the module docstring.
PATCHES = {
    "current_device": _patch_current_device,
    "rng": _patch_rng,
    "factories": _patch_factories,
    "clip_grads": _patch_clip_grads,
    "synchronize": _patch_synchronize,
    "streams": _patch_streams,
    "tensor_cuda": _patch_tensor_cuda,
    "optimizer_type_checks": _patch_optimizer_type_checks,
    "moe_te_gemm": _patch_moe_te_gemm,
    "moe_split_sizes": _patch_moe_split_sizes,
    "uneven_gather": _patch_uneven_gather,
}


def apply(force: bool = False, skip: tuple = ()) -> bool:
    """Apply the CPU patches if CUDA is absent (or ``force``). Returns True if active.

    Safe to call many times; call it before building any Megatron object. ``skip`` names
    patches to leave out, for the rest of the process; it exists so the tests can prove each
    patch is needed.
    """
    if torch.cuda.is_available() and not force:
        return False
    unknown = set(skip) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown CPU patch name(s) {sorted(unknown)}; known: {sorted(PATCHES)}")
    _SKIPPED.update(skip)
    for name, patch in PATCHES.items():
        if name not in _SKIPPED and not _APPLIED.get(name):
            patch()
            _APPLIED[name] = True
    return True


def is_applied() -> bool:
    return all(_APPLIED.get(name) for name in PATCHES)
