"""Adapters that plug ampgraph into training frameworks (Lightning, HF Trainer, ...).

Each module is a thin layer over the public API and imports its framework lazily, so
``import ampgraph`` stays lean (``tests/test_layering.py``).
"""
