"""Packages and the one folder mapping pyproject.toml cannot express.

`triton_kernels/` installs as `sekv_vllm.triton_kernels`: vLLM imports Triton's own
top-level `triton_kernels` package, which a top-level folder of ours would shadow. `csrc/`
installs as `sekv_vllm.csrc` (C++ sources compiled on first use, `sekv_vllm.ops.span_decode`).
"""
from setuptools import find_packages, setup

# Folders of data only, declared as packages so that their files ship (setuptools warns otherwise).
DATA_PACKAGES = {
    "sekv_vllm.router.shipped": ["*.safetensors", "*.json"],  # the shipped router weights and their provenance
    "sekv_vllm.csrc.cpu": ["*.cpp"],
}

setup(
    packages=find_packages(include=["sekv_vllm", "sekv_vllm.*"])
    + ["sekv_vllm.triton_kernels", "sekv_vllm.csrc", *DATA_PACKAGES],
    package_dir={"sekv_vllm.triton_kernels": "triton_kernels", "sekv_vllm.csrc": "csrc"},
    package_data=DATA_PACKAGES,
)
