"""The Pallas plumbing every op's GPU kernel shares.

Each op's kernels live in its folder, `nvfp4_jax/ops/<op>/pallas_triton.py`
(and `pallas_mosaic_gpu.py`, `triton.py`), beside the op's reference; what
they share sits here, below every op, one module per job:

- `launch`: backend checks, the launch helper, masked loads and stores of
  partial tiles, the tile configs' arithmetic;
- `fp32`: exact FP32 arithmetic in a kernel (correctly rounded division,
  flushes, NaN-propagating maxima, partial amaxes), and `fp32x2` its
  Blackwell packed (`.f32x2`) forms;
- `e2m1_encode`: the inline-PTX E2M1 encoders and where the GPU's own E2M1
  conversion is used (its compile probe); `e2m1_decode`: the decoders;
- `paired_words`: the quantize kernels' word paths (bf16 pairs as uint32
  words, through the E2M1 conversion), and `choose_four` their
  Four-over-Six choice;
- `mosaic_gemm`: the Mosaic GPU GEMMs' (Hopper) tile config, checks,
  warp-specialized pipeline and epilogue, shared by the dense and the
  grouped GEMM.

It imports only `nvfp4_jax.core`.
"""
