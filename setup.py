"""private_t5: differentially private pretraining and fine-tuning of T5 in JAX."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _requirements(name: str = "requirements.txt"):
  """The pinned runtime stack of requirements.txt (comments and blank lines dropped).

  `t5` itself is not among them: its declared dependencies pull duplicate nightly builds, so
  scripts/install.sh installs it with `pip install --no-deps t5==0.9.4` (see the README).
  """
  with open(os.path.join(HERE, name), encoding="utf-8") as f:
    lines = (line.split("#", 1)[0].strip() for line in f)
    return [line for line in lines if line]


setup(
    name="private_t5",
    version="0.1.0",
    description="Differentially private pretraining and fine-tuning of T5 (JAX/Flax)",
    packages=find_packages(include=["private_t5", "private_t5.*"]),
    python_requires=">=3.10",
    install_requires=_requirements(),
    package_data={"private_t5": ["configs/*/*.gin"]},
    include_package_data=True,
    entry_points={"console_scripts": ["private-t5=private_t5.stages.cli:main"]},
)
