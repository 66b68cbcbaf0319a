"""The package's two commands, the front ends over the library.

* ``cli``: ``pl-pipedream plan | simulate | reproduce`` (no torch, no Lightning);
* ``train``: ``pl-pipedream-train``, the Hydra app that trains with ``PipeDreamStrategy``
  (``python -m pl_pipedream.apps.train`` is the same app; other ranks are started that way).
"""
