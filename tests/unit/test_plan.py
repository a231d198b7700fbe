"""The dry-run planner: parameter counts and memory components against hand-computed values."""

import json
from pathlib import Path

import pytest

from megatron_stare.config.load import load_config
from megatron_stare.plan.planner import (GiB, estimate_memory, layer_activation_bytes, main, param_counts)

ROOT = Path(__file__).resolve().parents[2]
QWEN32 = ROOT / "examples" / "configs" / "qwen2.5-32b.json"
QWEN7 = ROOT / "examples" / "configs" / "qwen2.5-7b.json"
YAML32 = ROOT / "examples" / "qwen2.5_32b_longcot.yaml"
YAML7 = ROOT / "examples" / "qwen2.5_7b_shortcot.yaml"
#: The 32B recipe without the offload its plan advises (and the recipe takes): the hand numbers
#: below are for trainer state resident during the rollout, at vLLM's budget of 0.55.
NO_OFFLOAD32 = ["trainer.offload=none", "rollout.gpu_memory_utilization=0.55"]


def _cfg32(*overrides):
    return load_config(str(YAML32), [*NO_OFFLOAD32, *overrides])


def _hand_total(V, h, layers, heads, kv, ffn, tied=False):
    hd = h // heads
    q = h * h + h
    k = v = h * (kv * hd) + kv * hd
    o = h * h
    layer = q + k + v + o + 3 * h * ffn + 2 * h
    return V * h + layers * layer + h + (0 if tied else V * h)


def test_param_counts_qwen25_32b():
    c = param_counts(json.loads(QWEN32.read_text()))
    expected = _hand_total(V=152064, h=5120, layers=64, heads=40, kv=8, ffn=27648)
    assert c.total == expected == 32_763_876_352
    assert c.embedding == c.output_layer == 152064 * 5120
    assert c.attention == (5120 * 5120 + 5120) + 2 * (5120 * 1024 + 1024) + 5120 * 5120
    assert c.mlp == 3 * 5120 * 27648 and c.norms == 2 * 5120 and c.final_norm == 5120


def test_param_counts_qwen25_7b():
    c = param_counts(json.loads(QWEN7.read_text()))
    expected = _hand_total(V=152064, h=3584, layers=28, heads=28, kv=4, ffn=18944)
    assert c.total == expected == 7_615_616_512


def test_param_counts_tied_and_qwen3_norms():
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True}
    c = param_counts(base)
    q_dim, kv_dim = 4 * 32, 2 * 32
    assert c.output_layer == 0
    assert c.attention == 64 * q_dim + 2 * 64 * kv_dim + q_dim * 64  # no biases
    assert c.norms == 2 * 64 + 2 * 32  # q/k norms over the head dim
    assert c.total == 1000 * 64 + 2 * (c.attention + c.mlp + c.norms) + 64


def test_activation_formula_reduces_to_korthikanti():
    s, h, a, t = 2048, 1024, 16, 4
    gpt = dict(kv_dim=h, ffn=4 * h, gated=False, flash_attention=False)
    korth = s * h * (34 + 5 * a * s / h)
    assert layer_activation_bytes(s, h, a, **gpt) == pytest.approx(korth)
    assert layer_activation_bytes(s, h, a, tp=t, sequence_parallel=True, **gpt) == pytest.approx(korth / t)
    assert layer_activation_bytes(s, h, a, tp=t, **gpt) == pytest.approx(
        s * h * (10 + 24 / t + 5 * a * s / (h * t)))
    # Flash attention drops the quadratic term; SwiGLU with ffn = 4h keeps 6*ffn/h.
    assert layer_activation_bytes(s, h, a, h, 4 * h) == pytest.approx(s * h * (10 + 8 + 24))


def test_memory_components_32b_by_hand():
    cfg = _cfg32()
    plan = estimate_memory(cfg, json.loads(QWEN32.read_text()), world_size=32, gpu_mem_gb=80)
    L = plan.layout
    assert (L.tp, L.pp, L.cp, L.dp, L.layers_per_stage) == (8, 2, 2, 1, 32)
    assert (L.engine_instances, L.sequences_per_instance) == (4, 128)
    assert L.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 / 8
    # The last stage holds 32 layers, the final norm and the padded output layer (152576 rows).
    c = param_counts(json.loads(QWEN32.read_text()))
    n = 32 * (c.attention + c.mlp) / 8 + 32 * c.norms + 5120 + 152576 * 5120 / 8
    assert plan.stage == 1
    assert plan.weights_gib == pytest.approx(2 * n / GiB)
    assert plan.main_grads_gib == pytest.approx(4 * n / GiB)
    assert plan.optimizer_gib == pytest.approx(12 * n / 2 / GiB)  # sharded over dp*cp = 2
    s = 24576 // 2
    act = 1 * 32 * 2 * s * 5120 / 8 + s * 5120 * (10 + 2 + 4 * 1024 / 5120 + 2 + 6 * 27648 / 5120) / 8
    assert plan.activations_gib == pytest.approx(act / GiB)
    assert plan.logits_gib == pytest.approx((s * 19072 * 4 + 1024 * 19072 * 4) / GiB)
    assert plan.reference_gib == 0.0
    engine = plan.engine_kv_gib + plan.engine_weights_gib + plan.engine_workspace_gib
    assert engine == pytest.approx(0.55 * 80)  # vLLM reserves its whole budget
    assert plan.peak_gib == max(plan.phases.values()) and plan.fits
    # Data-parallel rollout: 4 replicas of TP8, 64 prompts -> 16 each. Sync per rank: the TP
    # all-gather brings 7 of 8 shards of the stage's split weights; every rank receives the model.
    assert (L.replicas, L.prompts_per_replica) == (4, 16)
    split = 32 * (c.attention + c.mlp) / 8 + 152576 * 5120 / 8
    assert L.sync_gathered_gib == pytest.approx(7 * split * 2 / GiB)
    assert L.sync_received_gib == pytest.approx(c.total * 2 / GiB)  # the HF model, unpadded
    assert L.sync_kept_gib == plan.engine_weights_gib and L.sync_kept_gib < L.sync_received_gib / 7


def test_recompute_optimizer_and_kl_change_the_right_parts():
    hf = json.loads(QWEN7.read_text())
    base = estimate_memory(load_config(str(YAML7)), hf, 8, 80)
    none = estimate_memory(load_config(str(YAML7), ["parallel.recompute=null"]), hf, 8, 80)
    assert none.activations_gib > 5 * base.activations_gib
    plain = estimate_memory(load_config(str(YAML7), ["parallel.distributed_optimizer=false"]), hf, 8, 80)
    assert plain.optimizer_gib == pytest.approx(base.optimizer_gib * 4)  # dp 4
    kl = estimate_memory(load_config(str(YAML7), ["algorithm.kl_loss_coef=0.001"]), hf, 8, 80)
    assert kl.reference_gib == pytest.approx(base.weights_gib)
    assert kl.phases["train"] == pytest.approx(base.phases["train"] + base.weights_gib)


def test_tied_embedding_is_copied_to_the_last_stage():
    hf = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 1024, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "tie_word_embeddings": True, "max_position_embeddings": 4096}
    cfg = load_config(None, ["parallel.pp=2", "rollout.engine=vllm-server", "model.dtype=bfloat16",
                             "rollout.server_urls=[http://rollout-node:8000]"])
    plan = estimate_memory(cfg, hf, 2, 80)
    c = param_counts(hf)
    assert plan.weights_gib == pytest.approx(2 * (2 * c.per_layer + 64 + 1024 * 64) / GiB)
    # An attached server runs on GPUs of its own; a spawned one shares the driver node's GPUs.
    assert plan.engine_weights_gib == 0 and not plan.layout.colocated
    cfg.rollout.server_urls = []
    spawned = estimate_memory(cfg, hf, 2, 80)
    assert spawned.engine_weights_gib > 0 and spawned.layout.colocated and spawned.layout.engine_instances == 1


def _run(capsys, args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_main_exit_codes(capsys):
    rc, out, _ = _run(capsys, ["--config", YAML32, "--world-size", 32, "--hf-config", QWEN32])
    assert rc == 0 and "fits" in out and "tp 8 x pp 2 x cp 2 x dp 1 = 32" in out
    rc, out, _ = _run(capsys, ["--config", YAML32, "--world-size", 8, "--gpu-mem-gb", 24,
                               "--hf-config", QWEN32, "parallel.pp=1", "parallel.cp=1",
                               "parallel.distributed_optimizer=false"])
    assert rc == 3 and "DOES NOT FIT" in out and "more than the 24 GiB" in out
    for bad, needle in [
        (["--world-size", 8], "not divisible by tp*pp*cp"),
        (["--world-size", 32, "parallel.tpp=8"], "did you mean 'parallel.tp'"),
        (["--world-size", 32, "rollout.max_new_tokens=200000"], "max_position_embeddings"),
        (["--world-size", 32, "rollout.tp=16"], "rollout.tp=16"),
        # The 32B layout against the model's real shape (40 heads, 8 KV heads, 64 layers, FFN
        # 27648), with model.path absent here: the shape comes from --hf-config.
        (["--world-size", 64, "parallel.tp=16"], "parallel.tp=16 does not divide the 40 attention heads"),
        (["--world-size", 48, "parallel.pp=3"], "parallel.pp=3 does not divide the 64 layers"),
        (["--world-size", 40, "parallel.tp=5", "parallel.pp=4", "rollout.tp=5", "parallel.sequence_parallel=false"],
         "parallel.tp=5 does not divide the 8 key/value heads"),
        (["--world-size", 32, "rollout.tp=32"], "rollout.tp=32 does not divide the 40 attention heads"),
        (["--world-size", 32, "parallel.micro_batch_tokens=16384"], "parallel.micro_batch_tokens=16384 is below"),
        (["--world-size", 32, "algorithm.stare.w=0.95"], "algorithm.stare.w must be >= 1"),
    ]:
        rc, out, err = _run(capsys, ["--config", YAML32, "--hf-config", QWEN32] + bad)
        assert rc == 2 and out == "" and needle in err, (bad, err)
        assert err.count("\n") == 1 and err.startswith("error: config: ")
    rc, _, err = _run(capsys, ["--config", YAML32, "--world-size", 32, "model.path=/nonexistent"])
    assert rc == 2 and "HF config not found" in err


def test_engine_without_room_for_one_sequence_does_not_fit(capsys):
    rc, out, _ = _run(capsys, ["--config", YAML32, "--world-size", 32, "--hf-config", QWEN32,
                               "rollout.gpu_memory_utilization=0.12"])
    assert rc == 3 and "less than one 22528-token sequence" in out


def test_plan_phases_are_the_training_loops():
    """One phase list (runtime/phases.py) for the loop and the planner; each phase holds what
    the engine holds then: everything while awake, a residue while released, the weights again
    from resume_w (plus one bucket in sync), everything from resume_kv."""
    from megatron_stare.plan.planner import PHASES
    from megatron_stare.runtime.phases import PHASES as STEP

    assert PHASES == tuple(p.name for p in STEP) == (
        "generate", "gather", "score", "release", "onload", "train", "resume_w", "sync", "offload", "resume_kv")
    p = estimate_memory(_cfg32(), json.loads(QWEN32.read_text()), world_size=32, gpu_mem_gb=80)
    ph = p.phases
    awake = p.engine_weights_gib + p.engine_kv_gib + p.engine_workspace_gib
    assert ph["generate"] == ph["gather"] == ph["score"] == ph["resume_kv"] == p.peak_gib
    assert ph["release"] == pytest.approx(ph["generate"] - awake + p.engine_asleep_gib)
    assert ph["train"] == pytest.approx(ph["release"] + p.activations_gib + p.logits_gib)
    assert ph["resume_w"] == pytest.approx(ph["release"] + p.engine_weights_gib)
    assert ph["sync"] == pytest.approx(ph["resume_w"] + p.sync_bucket_gib)
    # Without trainer.offload the onload and offload phases hold what their neighbours hold.
    assert ph["onload"] == ph["release"] and ph["offload"] == ph["resume_w"]
    header = next(ln for ln in p.format().splitlines() if ln.strip().startswith("component"))
    assert header.split()[1:] == list(PHASES)


def test_offload_line_32b_and_7b_by_hand():
    """What ``trainer.offload`` frees per GPU and the KV pool the engine gets from it, by hand:
    per TP rank of the stage that frees least, bf16 weights 2 B + fp32 grads 4 B + (master,
    m, v) 12 B / (dp*cp) per parameter ('optimizer': without the 2 B); the engine's fraction
    grows by freed / 80 GiB (rounded down to 0.01), its KV pool by the same bytes."""
    import math

    def rank_params(h, heads, kv, ffn, layers, vocab_padded, tp, embeddings, final_norm):
        hd = h // heads
        att = (h * h + h) + 2 * (h * kv * hd + kv * hd) + h * h
        split = layers * (att + 3 * h * ffn) + embeddings * vocab_padded * h
        return split / tp + layers * 2 * h + (h if final_norm else 0)

    # 32B: TP8 PP2 CP2 DP1, 32 layers a stage; vocab 152064 padded to a multiple of 128*8 = 152576.
    # Stage 0 (embedding, no final norm) frees least; optimizer shards over dp*cp = 2.
    n0 = rank_params(5120, 40, 8, 27648, 32, 152576, 8, embeddings=1, final_norm=False)
    for level, per_param in (("all", 2 + 4 + 12 / 2), ("optimizer", 4 + 12 / 2)):
        p = estimate_memory(_cfg32(f"trainer.offload={level}"),
                            json.loads(QWEN32.read_text()), world_size=32, gpu_mem_gb=80)
        o = p.layout.offload
        assert o.level == level and o.freed_gib == pytest.approx(n0 * per_param / GiB)
        assert o.utilization_before == 0.55
        assert o.utilization_after == math.floor((0.55 + n0 * per_param / GiB / 80) * 100) / 100
        kv_token = 2 * 64 * 1 * 128 * 2  # K and V, 64 layers, 8 KV heads / engine TP 8, head dim 128, bf16
        kv_after = o.utilization_after * 80 - p.engine_weights_gib - 2.0  # 2 GiB engine workspace
        assert o.kv_after_gib == pytest.approx(kv_after)
        assert o.sequences_after == int(kv_after * GiB // (22528 * kv_token)) > o.sequences_before == 49
        assert f"{o.sequences_before} -> {o.sequences_after} full-length sequences per replica" in p.format()
    assert (o.utilization_after, o.sequences_after) == (0.78, 76)  # 'optimizer': 19.1 GiB
    # The offloaded rows are gone from the generate column (all: 22.9 GiB of the stage's state).
    p = estimate_memory(_cfg32("trainer.offload=all"), json.loads(QWEN32.read_text()), 32, 80)
    plain = estimate_memory(_cfg32(), json.loads(QWEN32.read_text()), 32, 80)
    assert plain.layout.offload.level == "none" and "with trainer.offload=all" in plain.format()
    assert p.phases["generate"] == pytest.approx(plain.phases["generate"] - (
        plain.weights_gib + plain.main_grads_gib + plain.optimizer_gib))
    assert p.phases["train"] >= plain.phases["train"] - 1.0  # the train phase keeps everything
    # 7B: TP2 DP4, one stage with both embeddings and the final norm; vocab 152064 (a multiple
    # of 128*2); optimizer shards over dp = 4.
    n = rank_params(3584, 28, 4, 18944, 28, 152064, 2, embeddings=2, final_norm=True)
    p7 = estimate_memory(load_config(str(YAML7), ["trainer.offload=all"]), json.loads(QWEN7.read_text()), 8, 80)
    o7 = p7.layout.offload
    assert o7.freed_gib == pytest.approx(n * (2 + 4 + 12 / 4) / GiB)
    assert o7.utilization_after == math.floor((0.45 + n * 9 / GiB / 80) * 100) / 100 == 0.84
    assert o7.sequences_before == 246 >= 128  # the 7B pool already holds a replica's whole batch


def test_sync_staging_by_role_and_first_sync_by_hand():
    """The sync's staging (plan/sync.py) on the planned stage, by hand from what the export
    allocates: the TP-gather scratch (the stage's largest full tensor), the concatenation
    scratch (the GLU fc1, full), two own staging slots (a bucket and the largest HF tensor when
    it exceeds one) and, with PP, two slots for the other stages' buckets; the first sync adds
    it to the generate column (engine awake, trainer state resident)."""
    B32, B7 = 1024 * 2**20, 512 * 2**20
    # 32B last stage, TP8 PP2, bf16: the padded output layer 152576 x 5120; fc1 2 x 27648 x 5120;
    # the HF lm_head / embed_tokens 152064 x 5120 (1.45 GiB) exceed a 1 GiB bucket.
    p = estimate_memory(_cfg32(), json.loads(QWEN32.read_text()), world_size=32, gpu_mem_gb=80)
    st = p.layout.sync_staging
    hf_vocab = 152064 * 5120 * 2
    assert (st.gather, st.join) == (152576 * 5120 * 2, 2 * 27648 * 5120 * 2)
    assert st.own == st.received == B32 + hf_vocab
    assert p.sync_bucket_gib == pytest.approx(st.total / GiB) and 6.5 < st.total / GiB < 7.5
    assert p.layout.first_sync_gib == pytest.approx(p.phases["generate"] + st.total / GiB)
    assert p.fits and p.layout.first_sync_gib > p.peak_gib  # 79.3 of 80 GiB: the tightest moment
    assert "the first sync (start, resume) runs with the engine awake" in p.format()
    # A larger bucket makes the first sync the reason it does not fit; offload runs it released.
    big = estimate_memory(_cfg32("rollout.sync_bucket_mb=2048"),
                          json.loads(QWEN32.read_text()), 32, 80)
    assert not big.fits and "the first weight sync" in big.reasons[0] and "trainer.offload" in big.reasons[0]
    off = estimate_memory(_cfg32("rollout.sync_bucket_mb=2048", "trainer.offload=all"),
                          json.loads(QWEN32.read_text()), 32, 80)
    assert off.fits and off.layout.first_sync_gib == off.phases["sync"]
    # 7B, TP2 PP1, 512 MiB buckets: vocab 152064 is already a multiple of 256; no other stage.
    p7 = estimate_memory(load_config(str(YAML7)), json.loads(QWEN7.read_text()), 8, 80)
    st7 = p7.layout.sync_staging
    assert (st7.gather, st7.join, st7.received) == (152064 * 3584 * 2, 2 * 18944 * 3584 * 2, 0.0)
    assert st7.own == B7 + 152064 * 3584 * 2
    # The piece export (an engine behind a process group): the collector's two buckets.
    srv = estimate_memory(load_config(str(YAML7), ["rollout.engine=vllm-server"]), json.loads(QWEN7.read_text()), 8, 80)
    assert srv.layout.sync_staging.total == 2 * B7


def test_recompute_auto_chooses_the_cheapest_that_fits_and_reaches_megatron():
    """``parallel.recompute=auto``: none when the plan fits without recompute (the 32B recipe's
    train phase: 41.4 GiB of 80 with 11.1 GiB of activations), full when only full fits (the 7B
    recipe on 72 GiB GPUs); the plan says why, and with 'full' what auto would choose. The
    choice reaches megatron-core's TransformerConfig; on CPU auto is none."""
    from megatron_stare.models.gpt import transformer_config
    from megatron_stare.plan.planner import choose_recompute, resolve_recompute
    from megatron_stare.testing.megatron_tiny import TINY_SPEC

    hf32, hf7 = json.loads(QWEN32.read_text()), json.loads(QWEN7.read_text())
    auto = estimate_memory(_cfg32("parallel.recompute=auto"), hf32, 32, 80)
    none = estimate_memory(_cfg32("parallel.recompute=none"), hf32, 32, 80)
    assert auto.layout.recompute == "none" and auto.phases == none.phases
    assert "recompute auto -> none: the train phase fits with no recompute (41.4 GiB of 80" in auto.format()
    full = estimate_memory(_cfg32(), hf32, 32, 80)
    assert full.layout.recompute == "full" and "auto would choose: recompute auto -> none" in full.format()
    assert full.phases["train"] < none.phases["train"] - 10  # what full recompute saves, unneeded here
    choice, why = choose_recompute(load_config(str(YAML7)), hf7, 8, 72)
    assert choice == "full" and "without recompute" in why
    assert estimate_memory(load_config(str(YAML7), ["parallel.recompute=auto"]), hf7, 8, 72).layout.recompute == "full"
    assert choose_recompute(load_config(str(YAML7)), hf7, 8, 80)[0] == "none"  # 78.8 GiB of 80
    assert resolve_recompute(load_config(str(YAML7)), str(QWEN7), 8)[0] == "none"  # CPU
    for choice, granularity in (("none", None), (None, None), ("selective", "selective"), ("full", "full")):
        c = transformer_config(TINY_SPEC, 1, 1, recompute=choice)
        assert c.recompute_granularity == granularity
    assert transformer_config(TINY_SPEC, 1, 1, recompute="full").recompute_method == "uniform"


def test_colocated_sglang_budgets_its_tp_ranks_ipc_contexts():
    """Colocated SGLang at TP > 1: its other TP ranks map the weight buckets on the group leader's
    GPU over CUDA IPC, a CUDA context each there (rollout/engines/sglang/engine.py); vLLM opens none."""
    hf = json.loads(QWEN7.read_text())
    vllm = estimate_memory(load_config(str(YAML7), ["rollout.tp=4"]), hf, 8, 80)
    sgl = estimate_memory(load_config(str(YAML7), ["rollout.engine=sglang", "rollout.tp=4"]), hf, 8, 80)
    assert vllm.ipc_contexts_gib == 0 and sgl.ipc_contexts_gib == pytest.approx(3 * 0.5)
    assert sgl.phases["train"] == pytest.approx(vllm.phases["train"] + 1.5)
    assert "engine TP ranks' IPC contexts" in sgl.format()
