"""Benchmark sizes (Llama-3-8B-like, bfloat16): the one place they are written down."""

TOKENS = 16384  # B * T of a training micro-batch
HIDDEN = 4096  # d_model
BATCH, SEQ = 4, 4096  # TOKENS split for RoPE
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SWIGLU_TOKENS, FFN = 8192, 14336
CE_TOKENS, VOCAB = 8192, 128256
LCE_CHUNK_ALTERNATIVES = (256, 384)  # extra chunk sizes benchmarked beside the default
MATMUL_SIZES = (4096, 8192)
COPY_ELEMENTS = 1 << 30  # 2 GiB of bfloat16 for the copy-bandwidth ceiling
EPS = 1e-6
