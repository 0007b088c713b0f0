"""Which temperatures mean greedy decoding: one bound for the engine and the caches."""

from __future__ import annotations

# Temperatures below this are greedy, as in vLLM: a token 1e-3 below the best already
# weighs e^-100 of it there, so a draw could only differ from the argmax among ties
# within the logits' rounding, while the scale 1/T runs on to float32's overflow (T near
# 3e-39), where a draw has no meaning left.
GREEDY_TEMPERATURE = 1e-5
