"""megatron_pipemesh: PipeMesh's elastic pipeline schedule for Megatron-LM."""
import re

from setuptools import find_packages, setup

# The version is declared once, in the package (``pipemesh --version`` prints it); read as text, since importing the
# package here would need its requirements installed first.
VERSION = re.search(r'^__version__ = "([^"]+)"', open("megatron_pipemesh/__init__.py", encoding="utf-8").read(),
                    re.M).group(1)

setup(
    name="megatron_pipemesh",
    version=VERSION,
    description=(
        "PipeMesh elastic pipeline schedule (Li et al., IEEE TPDS 2025) for Megatron-LM: "
        "forward/backward micro-batch groups, simulator, planner and runtime."
    ),
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_pipemesh", "megatron_pipemesh.*"]),
    package_data={"megatron_pipemesh": ["data/corpus/*.txt", "planning/advice_error.json"]},
    # torch and megatron-core are deliberately not hard requirements: GPU users install the package
    # into an environment that already has them (CUDA torch, megatron-core 0.19.x); the pure
    # schedule/planning layers and the `pipemesh` command need neither.  matplotlib is, so that
    # `pipemesh simulate --plot` / `pipemesh bench --plot` work after a plain `pip install`.
    install_requires=["numpy", "matplotlib"],
    extras_require={
        "plot": [],  # kept so that `pip install megatron_pipemesh[plot]` still works; now a requirement
        "test": ["pytest", "pytest-xdist", "hypothesis", "typing_extensions"],
    },
    entry_points={
        "console_scripts": [
            "pipemesh=megatron_pipemesh.command:main",
            "pipemesh-pretrain-gpt=megatron_pipemesh.training.pretrain_gpt:main",
        ]
    },
)
