"""P-EAGLE drafting inside transformers' `generate()`.

- [`stats`]: [`PEagleGenerationStats`], the one statistics object (named metrics, mergeable);
- [`drafting`]: [`DraftingSession`], one drafting round per verify pass through [`PEagleDrafter.draft_round`], from
  [`settings`] (the call's settings), [`drafter_cache`], [`processing`] (per-row logits processing) and [`policy`]
  (fixed, threshold or cost-aware drafting);
- [`decoding`]: the decoding loop for 1..N rows, chains or draft trees ([`tree`], [`tree_drafting`]);
- [`hook`]: the version-guarded dispatch hook `import peagle` installs; [`checks`]: the request checks;
- [`rule`], [`cost`]: cost-aware drafting: the pure rule and the measured verify-cost model;
- [`calibration`]: per-depth calibration of the head's draft probabilities (`peagle calibrate`).
"""

from .checks import MIN_TRANSFORMERS_VERSION, check_generation_request, declare_stateless_processor
from .decoding import PEagleGenerateOutput
from .drafting import DraftingSession
from .hook import install_generate_hook, uninstall_generate_hook
from .settings import resolve_confidence_threshold, resolve_num_speculative_tokens
from .stats import PEagleGenerationStats

__all__ = [
    "DraftingSession",
    "PEagleGenerationStats",
    "PEagleGenerateOutput",
    "check_generation_request",
    "declare_stateless_processor",
    "resolve_num_speculative_tokens",
    "resolve_confidence_threshold",
    "install_generate_hook",
    "uninstall_generate_hook",
    "MIN_TRANSFORMERS_VERSION",
]
