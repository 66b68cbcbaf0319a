"""``pl-pipedream reproduce``: PipeDream's Table 1 next to what our planner predicts for it.

For each row of the paper's Table 1 (SOSP 2019) the planner partitions the model over the row's
cluster, and the command prints the paper's configuration and speedup over data parallelism
beside ours. One module per job:

* ``table``: the rows of Table 1 that ship with the package (``pl_pipedream.published``);
* ``profiles``: our own models profiled on this machine (torch, cached);
* ``epochs``: one epoch of data parallelism, PipeDream and GPipe from a plan's cost model;
* ``predict``: each row planned on its cluster and simulated;
* ``report``: the table as text or Markdown, and the assumptions printed under it;
* ``chart``: the speedups as grouped bars (matplotlib, the ``plot`` extra);
* ``command``: the subcommand's arguments and its run.

Only ``profiles`` imports torch, and only when our own profile is asked for.
"""
