"""What the KV pool may store besides the model's dtype.

`kv_cache_dtype="fp8"`: e4m3 bytes (finite to +-448, no infinities), K and V divided by the
checkpoint's calibrated scales where it has them (kv_scales), else as they are. Writes clamp
to the finite range before rounding; attention widens each row back to the model's dtype as
it reads.
"""

from __future__ import annotations

import torch

FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = 448.0
