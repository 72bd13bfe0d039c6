"""Install ``megatron.sdp4bit`` as a portion of the ``megatron`` namespace package.

``megatron`` has no ``__init__.py`` here or in ``megatron-core``: both distributions
contribute sub-packages (``megatron.core`` and ``megatron.sdp4bit``) to one namespace.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="sdp4bit-megatron",
    version="0.2.0",
    description="SDP4Bit: 4-bit communication quantization for Megatron-Core's distributed optimizer",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["megatron.sdp4bit", "megatron.sdp4bit.*"]),
    # The CPU kernels' C source is compiled on first use (quantization/cpu_kernels.py).
    package_data={"megatron.sdp4bit.quantization": ["cpu_kernels.c"]},
    install_requires=[
        # The tested pins. A CUDA build of torch 2.13.0 (2.13.0+cuXXX) satisfies the pin.
        "torch==2.13.0",
        # The tested megatron-core release for the interpreter (0.19.2 requires Python >= 3.12).
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core==0.19.2; python_version >= '3.12'",
        # No upper bound and no exact pin: a CUDA torch pins its own triton, which wins.
        "triton>=3.2; platform_system == 'Linux'",
        "numpy>=1.26",
        "tokenizers>=0.19",
        "sentencepiece>=0.2",
        "psutil>=5.9",  # megatron-core's torch_dist checkpoint writer
    ],
    extras_require={
        "test": ["pytest>=8"],
        "logging": ["tensorboard>=2.16"],  # --tensorboard-dir
        "wandb": ["wandb>=0.16"],  # --wandb-project
        # GPU clusters: Transformer Engine's layers and attention kernels
        # (--transformer-impl transformer_engine). 2.9 to 2.11: the range megatron-core
        # 0.16.1 declares (its "dev" extra); 0.19.2's "te" extra takes any release. Wheels of
        # the core library for CUDA 13 as megatron-core's extras choose; with a CUDA 12 build
        # of torch install transformer-engine[core_cu12,pytorch] of the same range instead.
        "te": ["transformer-engine[core_cu13,pytorch]>=2.9.0,<2.12.0"],
        "plot": ["matplotlib>=3.8"],  # tools/plot_metrics.py, tools/loss_compare.py
        "export": ["transformers>=4.40", "safetensors>=0.4"],  # tools/checkpoint/export_hf.py
    },
)
