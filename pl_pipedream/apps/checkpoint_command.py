"""``pl-pipedream checkpoint inspect|to-torch|to-lightning|from-torch``: arguments and run.

* ``inspect PATH`` prints a checkpoint saved under ``PipeDreamStrategy``: the step, the sync
  mode, the microbatches, the plan that saved it, every shard file with its size, and every name
  with its shape, dtype and stage (each shard checked against its sha256 record first);
* ``to-torch PATH OUT`` writes the LightningModule's full ``state_dict`` (what
  ``consolidate_checkpoint`` returns) to ``OUT`` with ``torch.save``;
* ``to-lightning PATH OUT`` writes one Lightning checkpoint file (weights, optimizer states by
  position, loops, callbacks, LR schedulers) that ``Trainer(...).fit(model, ckpt_path=OUT)``
  resumes from on one device;
* ``from-torch IN OUT`` makes a checkpoint directory from a plain state dict (or a Lightning
  ``.ckpt`` file's ``state_dict``): one stage holding every name, step 0.

The work is ``core.checkpoint_tools``'s, imported when the subcommand runs, so that this module
(and with it ``pl-pipedream plan``) imports neither torch nor Lightning.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's actions and their arguments, added to ``parser``."""
    actions = parser.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser("inspect", help="print a checkpoint's plan, shards and names")
    inspect.add_argument("path", help="the directory trainer.save_checkpoint wrote")
    to_torch = actions.add_parser("to-torch", help="write one plain torch.save state dict")
    to_torch.add_argument("path", help="the directory trainer.save_checkpoint wrote")
    to_torch.add_argument("out", help="the file to write")
    to_lightning = actions.add_parser(
        "to-lightning", help="write one Lightning .ckpt file that one device resumes from"
    )
    to_lightning.add_argument("path", help="the directory trainer.save_checkpoint wrote")
    to_lightning.add_argument("out", help="the .ckpt file to write")
    from_torch = actions.add_parser(
        "from-torch", help="make a pipeline checkpoint from a state dict or Lightning .ckpt"
    )
    from_torch.add_argument("source", metavar="in", help="a torch.save state dict or .ckpt file")
    from_torch.add_argument("out", help="the checkpoint directory to create")
    from_torch.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers of configure_pipeline() recorded in the one-stage plan (default: 1)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; a ``CheckpointError`` (a ``ValueError``) reaches the caller."""
    from pl_pipedream.core import checkpoint_tools

    if args.action == "inspect":
        print(checkpoint_tools.describe(args.path))
    elif args.action == "to-torch":
        state = checkpoint_tools.to_torch(args.path, args.out)
        print(f"wrote {len(state)} names to {args.out}")
    elif args.action == "to-lightning":
        checkpoint = checkpoint_tools.to_lightning_file(args.path, args.out)
        print(
            f"wrote a Lightning checkpoint of step {checkpoint.get('global_step')} to "
            f"{args.out}: resume on one device with Trainer(...).fit(model, "
            f"ckpt_path={str(args.out)!r})"
        )
    else:
        checkpoint_tools.from_torch(args.source, args.out, args.layers)
        print(f"wrote {args.out}: one stage on one worker, step 0")
    return 0
