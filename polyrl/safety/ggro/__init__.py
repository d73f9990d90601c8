"""GGRO: gradient-guided reward optimisation at decoding time vs best-of-N (spec §11, arXiv 2606.09635).

``core``: the method (``entropy``, ``first_order_swap_scores``, ``embedding_distance_bias``, ``ggro_decode``, the
``Generator``-compatible ``GGRODecoder``, counted ``Compute``); ``toy``: the synthetic world (grammar, tiny LM, proxy
RM sharing its embeddings); ``experiment``: `polyrl safety ggro` (report.html + results.json).
"""

from __future__ import annotations

from polyrl.safety.ggro.experiment import add_parser, run_command

__all__ = ["add_parser", "run_command"]
