"""Scripts that measure forge-jax and reproduce the paper's tables."""
