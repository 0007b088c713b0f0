"""Triton kernels of the CUDA attention path, each beside its launch wrapper.

`paged_attention` attends a mixed batch (prefill chunks and decodes) over the paged KV
pool; `kv_write` scatters a step's new K/V rows into their pool slots. Both are registered
as torch custom ops (`batchinfer::*`), so CUDA-graph capture, FakeTensorMode and
`torch.compile` see one opaque op each. `reference` holds the plain torch versions that
define what the kernels compute; tests compare the two.

Importing this package needs Triton (bundled with torch's CUDA wheels). Under
`TRITON_INTERPRET=1`, set before the first import, the kernels run on CPU tensors.
"""
