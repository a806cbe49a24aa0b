"""The former home of correlated noise's transform: `noise.noise_transform(noisy_sum, strategy)`.

The one noise transform of a DP step (Gaussian noise is its one-band identity strategy) and its
state live in `noise`; the names below still read from here for one release (`moved_names`).
"""
from private_t5 import moved_names

__getattr__ = moved_names.moved(__name__, {"private_t5.dp.noise": ("correlated_noise", "CorrelatedNoiseState")})
