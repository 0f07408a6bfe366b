"""What rewritten graphs call at run time: the weight cache and the attention kernels.

Imports nothing from ``ampgraph.cli``, ``ampgraph.monitor`` or ``ampgraph.integrations``
(``tests/test_layering.py``).
"""
