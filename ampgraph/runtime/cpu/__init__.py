"""The CPU runtime: oneDNN-packed inference weights, blocked products, kept gradient and
output buffers, chunked unfused attention and the faster dropout draw.

Each trade-off is measured in docs/performance.md#runtime-choices.
"""
