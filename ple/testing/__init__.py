"""Tools for testing PLE kernels against the reference: tolerances and Hypothesis strategies.

``ple.testing.numerics`` holds the tolerance table (SPEC section 8) and the
comparison helpers every equivalence test uses; ``ple.testing.strategies`` holds
Hypothesis strategies for configs, varlen batches and serving schedules.
"""
