"""`polyrl safety probe`: the neutral mask (spec §7, Tam arXiv 2606.09735) -- probe directions, their persistence
between a base and an RL-tuned model, a small sparse autoencoder, and activation steering.

Library API: ``fit_probe_direction`` / ``fit_probe`` (diff-of-means or logistic), ``direction_persistence``
(cosine, transfer accuracy, projection std and range ratios), ``train_sae`` / ``feature_activation_rates``
(ReLU + L1 or top-k SAE in torch), ``steer`` (context manager: a forward hook adding alpha * direction to one
block's output), ``residual_activations``. The experiment: ``experiment.run_seed``; the command: ``command``.
"""

from __future__ import annotations

from polyrl.safety.probe.command import add_parser
from polyrl.safety.probe.directions import (
                                            Probe,
                                            direction_persistence,
                                            fit_probe,
                                            fit_probe_direction,
                                            projection_stats,
)
from polyrl.safety.probe.hooks import decoder_layers, residual_activations, steer
from polyrl.safety.probe.sae import SparseAutoencoder, feature_activation_rates, train_sae

__all__ = ["Probe", "SparseAutoencoder", "add_parser", "decoder_layers", "direction_persistence",
           "feature_activation_rates", "fit_probe", "fit_probe_direction", "projection_stats",
           "residual_activations", "steer", "train_sae"]
