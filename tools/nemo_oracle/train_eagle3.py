"""Train NeMo AutoModel 0.7.0's own EAGLE-3 recipe (``TrainEagle3Recipe``) for a few steps on CPU; print its losses.

In: a target checkpoint, a chat JSONL, the backend (``colocated``: NeMo's in-process target, its loader swapped
for transformers' as in make_eagle3_fixtures.py; ``remote``: the URL(s) of a running ``ds-capture serve``), the
number of epochs (one optimizer step per micro-batch). Out (stdout, the last line): one JSON object with the per-step
losses (float32, as NeMo's trainer computes them, one per micro-batch), their accuracies and steps/s (between the
first and the last step).
Nothing else of NeMo is changed: fp32, fixed seeds, one process (its own gloo process group):

    python tools/nemo_oracle/train_eagle3.py --target T --data D --epochs 1 [--remote-url http://127.0.0.1:P ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def single_process_env() -> None:
    """The environment NeMo's recipes read for a world of one on this host (a free rendezvous port), NCCL off."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    os.environ["NEMO_EAGLE_ENABLE_NCCL"] = "0"


def recipe_config(args, out_dir: str) -> dict:
    recipe = {
        "target_model_name_or_path": args.target, "train_data_path": args.data, "seq_length": args.seq_length,
        "micro_batch_size": args.batch_size, "num_epochs": args.epochs, "ttt_steps": args.ttt_steps,
        "draft_vocab_size": args.draft_vocab_size, "output_dir": out_dir, "log_every_steps": 1,
        "shuffle_seed": 42, "num_workers": 0, "target_attn_implementation": "sdpa",
        "target_model_backend": "remote" if args.remote_url else "colocated",
        "target_prefetch_depth": args.prefetch,
    }
    if args.aux_layer_ids:
        recipe["aux_layer_ids"] = args.aux_layer_ids
    if args.remote_url:
        recipe["remote_urls"] = list(args.remote_url)
        recipe["remote_timeout"] = args.remote_timeout
        recipe["remote_max_retries"] = args.remote_max_retries
    return {"recipe_args": recipe, "dist_env": {"backend": "gloo", "timeout_minutes": 2},
            "optimizer": {"lr": 1e-3, "warmup_ratio": 0.0}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--ttt-steps", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=96)
    parser.add_argument("--aux-layer-ids", type=int, nargs="*")
    parser.add_argument("--prefetch", type=int, default=0)
    parser.add_argument("--remote-url", action="append")
    parser.add_argument("--remote-timeout", type=int, default=60, help="NeMo's remote_timeout (s per try)")
    parser.add_argument("--remote-max-retries", type=int, default=0,
                        help="NeMo's remote_max_retries (connection errors and timeouts; 1, 2, 4, ... s apart)")
    args = parser.parse_args(argv)

    single_process_env()
    import torch
    from make_eagle3_fixtures import _install_loader_shim

    _install_loader_shim()
    import nemo_automodel.recipes.llm.train_eagle3 as train_eagle3
    from nemo_automodel._transformers import NeMoAutoModelForCausalLM
    from nemo_automodel.components.config.loader import ConfigNode

    train_eagle3.NeMoAutoModelForCausalLM = NeMoAutoModelForCausalLM  # the shim (imported by name there)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out_dir:
        recipe = train_eagle3.TrainEagle3Recipe(ConfigNode(recipe_config(args, out_dir)))
        recipe.setup()
        losses, accuracies, stamps = [], [], []
        forward = recipe._forward_batch

        def recording(batch, target_batch=None):
            metrics = forward(batch, target_batch)
            losses.append(float(metrics.loss.detach()))
            accuracies.append(float(metrics.accuracy.detach()))
            stamps.append(time.perf_counter())
            return metrics

        recipe._forward_batch = recording
        recipe.run_train_validation_loop()
        # Steps/s between the first and the last step's forward: the loop's setup and its final checkpoint aside.
        seconds = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1) * len(stamps) if len(stamps) > 1 else 1.0
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    print(json.dumps({"losses": losses, "accuracies": accuracies, "steps": len(losses),
                      "steps_per_s": len(losses) / seconds, "backend": recipe_config(args, "")["recipe_args"][
                          "target_model_backend"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
