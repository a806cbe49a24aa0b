"""private_t5: differentially private pretraining and fine-tuning of T5 in JAX."""
from setuptools import find_packages, setup

setup(
    name="private_t5",
    version="0.1.0",
    description="Differentially private pretraining and fine-tuning of T5 (JAX/Flax)",
    packages=find_packages(include=["private_t5", "private_t5.*"]),
    python_requires=">=3.10",
    package_data={"private_t5": ["configs/**/*.gin"]},
    entry_points={"console_scripts": ["private-t5=private_t5.cli:main"]},
)
