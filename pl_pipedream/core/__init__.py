"""The Lightning-free core under the strategy: what any front end of the pipeline needs.

Between ``runtime`` and ``strategy``: the pipeline's setup pieces (cutting a stage, creating it
from an empty build, placing it), the data and divergence checks, and the sharded checkpoint's
format and exchange. Nothing here imports Lightning (``tests/test_layers.py``); the strategy
wires these into Lightning's hooks.
"""
