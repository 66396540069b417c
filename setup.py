from setuptools import find_packages, setup

setup(
    name="deepspeed_feplb",
    version="0.1.0",
    description="FEPLB for DeepSpeed: per-micro-batch MoE load balancing through the GPU Copy Engine",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed_feplb", "deepspeed_feplb.*"]) + ["deepspeed_feplb.ops"],
    package_dir={"deepspeed_feplb.ops": "ops"},  # the CUDA sources ship inside the package
    package_data={"deepspeed_feplb": ["trace/data/*.npz", "testing/data/*.npz"], "deepspeed_feplb.ops": ["*.cu"]},
    python_requires=">=3.9",
    # torch is not pinned here: install torch (CPU or CUDA build) first, see README.
    install_requires=["deepspeed>=0.19.8", "torch>=2.4", "pydantic>=2.7", "numpy>=1.24", "numba>=0.60"],
    extras_require={
        # transformers: AutoEP needs 5.x's fused expert weights; >= 5.23 breaks DeepSpeed's presets (docs/AUTOEP.md)
        # ruff: `make test` lints first (ruff.toml); a new minor version may add checks, so it is held to one
        # cuda-bindings: its API, not a GPU, is what a test checks the typed driver calls against
        "test": ["pytest>=8", "hypothesis>=6", "highspy>=1.7", "transformers>=5.0,<5.23", "ruff>=0.17.6,<0.18",
                 "cuda-bindings>=12.6"],
        "hf": ["transformers>=5.0,<5.23"],
        # one CuPy for torch's CUDA major version; install none if the environment already imports cupy
        # cuda-bindings: the driver's stream memory operations through NVIDIA's typed bindings
        "gpu": ["cupy-cuda12x>=13", "cuda-bindings>=12.6,<13"],
        "gpu-cuda13": ["cupy-cuda13x>=13.6", "cuda-bindings>=13"],
        "plot": ["matplotlib>=3.7", "tqdm>=4.60"],
    },
    entry_points={
        "console_scripts": ["feplb=deepspeed_feplb.__main__:main"],
        # the name must be the module path: `-p deepspeed_feplb.testing.plugin` then stays a no-op
        "pytest11": ["deepspeed_feplb.testing.plugin = deepspeed_feplb.testing.plugin"],
    },
)
