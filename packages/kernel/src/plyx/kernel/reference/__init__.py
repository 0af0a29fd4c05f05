"""Pure-PyTorch reference implementations of every kernel name: they run on any device.

Each is the definition the faster implementations are tested against, and each
passes ``torch.autograd.gradcheck`` in float64 (``grouped_gemm`` is the per-expert loop; ``rope_store_kv``, ``store_kv_quant``, ``rmsnorm_linear``, ``swiglu_linear`` and ``gemv`` are inference only: no gradient).
"""

from plyx.kernel.reference.cross_entropy import cross_entropy
from plyx.kernel.reference.gemv import gemv
from plyx.kernel.reference.grouped_gemm import grouped_gemm
from plyx.kernel.reference.linear_cross_entropy import linear_cross_entropy
from plyx.kernel.reference.matmul import matmul
from plyx.kernel.reference.moe_permute import moe_permute
from plyx.kernel.reference.moe_unpermute import moe_unpermute
from plyx.kernel.reference.rmsnorm import rmsnorm
from plyx.kernel.reference.rmsnorm_linear import rmsnorm_linear
from plyx.kernel.reference.rope import rope
from plyx.kernel.reference.rope_qk import rope_qk
from plyx.kernel.reference.rope_store_kv import rope_store_kv
from plyx.kernel.reference.rope_store_kv_quant import rope_store_kv_quant
from plyx.kernel.reference.store_kv_quant import KV_QUANT_DTYPES, dequantize_kv, quantize_kv, store_kv_quant
from plyx.kernel.reference.swiglu import swiglu
from plyx.kernel.reference.swiglu_linear import swiglu_linear

__all__ = ["KV_QUANT_DTYPES", "dequantize_kv", "quantize_kv", "store_kv_quant", "cross_entropy", "gemv", "grouped_gemm", "linear_cross_entropy", "matmul", "moe_permute", "moe_unpermute", "rmsnorm", "rmsnorm_linear", "rope", "rope_qk", "rope_store_kv", "rope_store_kv_quant", "swiglu", "swiglu_linear"]
