"""One drafter of the acceptance pipeline (benchmarks/pipeline.py): trained by NeMo AutoModel 0.7.0's own
``train_eagle3`` recipe, its acceptance length (tau) measured two ways. Runs in a process of its own (NeMo's
import is slow and rewrites transformers' auto mappings):

    python benchmarks/pipeline_nemo.py --target T --cache C | --remote-url U --data D.jsonl \\
        --heldout-cache H --heldout-data R.jsonl --epochs E --eval-every K --out result.json

Training: ``TrainEagle3Recipe`` from a ds_capture EAGLE-3 cache (``cached_target_path``) or against a running
``ds-capture serve`` (``target_model_backend: remote``), fp32 on CPU, one process (its own gloo group). One change
to the recipe as NeMo builds it: its train loader draws batches in an order fixed by ``--seed`` (NeMo's cache
loader shuffles with torch's global generator and its data loader with ``shuffle_seed``, so the two paths would
otherwise see the same rows in different orders).

Tau, at 0 steps (untrained), every ``--eval-every`` optimizer steps and at the end:
- ``nemo``: NeMo's ``simulated_accept_length`` over the held-out cache: the trainer module's own forward
  (its ``ttt_steps`` = the draft tokens) on every held-out row, prefix hits and valid chains summed, as
  ``TrainEagle3Recipe._run_eval`` sums them;
- ``decoder`` (untrained and final only): greedy speculative decoding on the held-out prompts. For every assistant
  turn of the regenerated held-out rows, from the conversation before it: the drafter proposes ``ttt_steps``
  tokens one at a time, each from its own previous proposal; one forward of the target (transformers' own class,
  fp32) verifies them; the longest prefix that equals the target's greedy tokens is accepted, plus the target's
  own next token. Tau = generated tokens / verification forwards, up to the end-of-turn token or
  ``--max-new-tokens`` (the regeneration's ``--max-tokens``). ``decoder_turns_equal`` counts the turns whose
  decoded tokens equal the regenerated turn's (the server's greedy answer), a check that both sides decode alike.
  ``tau_every_position``: the same proposals from every position of the greedy answer, not only from those the
  decoder reached, reduced as NeMo reduces its prefix hits (1 + the sum over depths of the fraction of chains still
  right); where it meets ``nemo`` and ``tau`` does not, the difference is which positions a decoder drafts from.

Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "nemo_oracle"))
from train_eagle3 import single_process_env  # noqa: E402  (NeMo's world-of-one environment, as the oracle sets it)


def recipe_config(args, out_dir: str) -> dict:
    recipe = {
        "target_model_name_or_path": args.target, "seq_length": args.seq_length,
        "micro_batch_size": args.batch_size, "num_epochs": args.epochs, "ttt_steps": args.draft_tokens,
        "output_dir": out_dir, "log_every_steps": 10**9, "shuffle_seed": args.seed, "num_workers": 0,
        "aux_layer_ids": args.aux_layer_ids, "mask_reasoning_content": False, "mask_generation_prompt": False,
    }
    if args.cache:
        recipe["cached_target_path"] = args.cache
    else:
        recipe.update({"target_model_backend": "remote", "train_data_path": args.data,
                       "remote_urls": [args.remote_url], "remote_timeout": 120, "remote_max_retries": 0})
    return {"recipe_args": recipe, "dist_env": {"backend": "gloo", "timeout_minutes": 5},
            "optimizer": {"lr": args.lr, "warmup_ratio": 0.05}, "checkpoint": {"enabled": False}}


def _fixed_order(loader, seed: int):
    """``loader`` again, drawing its batches in an order fixed by ``seed`` (the same for any dataset length)."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    sampler = RandomSampler(loader.dataset, generator=torch.Generator().manual_seed(seed))
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn,
                      num_workers=0, drop_last=False)


def nemo_tau(trainer_module, heldout_cache: str, batch_size: int) -> float:
    """NeMo's simulated accept length over every row of the held-out cache (as ``_run_eval`` sums its windows)."""
    import torch
    from nemo_automodel.components.datasets.llm.eagle3_cache import build_cached_eagle3_dataloader
    from nemo_automodel.components.speculative.eagle.core import simulated_accept_length

    loader = build_cached_eagle3_dataloader(cache_dir=heldout_cache, batch_size=batch_size, shuffle=False)
    hits = valid = None
    was_training = trainer_module.training
    trainer_module.eval()
    with torch.no_grad():
        for batch in loader:
            metrics = trainer_module(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], loss_mask=batch["loss_mask"],
                aux_hidden_states=batch["aux_hidden_states"], target_probs=batch["target_probs"],
                position_mask=batch["position_mask"])
            step_hits, step_valid = metrics.step_prefix_hits.float(), metrics.step_valid.float()
            hits = step_hits if hits is None else hits + step_hits
            valid = step_valid if valid is None else valid + step_valid
    trainer_module.train(was_training)
    return float(simulated_accept_length(hits, valid))


class SpeculativeDecoder:
    """Greedy chain speculative decoding: a NeMo EAGLE-3 drafter proposes, a transformers forward verifies."""

    def __init__(self, target_path: str, aux_layer_ids: list[int], draft_tokens: int, max_new_tokens: int) -> None:
        import torch
        import transformers

        config = transformers.AutoConfig.from_pretrained(target_path)
        # The class by name: NeMo's import remaps transformers' auto classes to its own.
        model_class = getattr(transformers, config.architectures[0])
        self.target = model_class.from_pretrained(target_path, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(target_path)
        self.aux_layer_ids = aux_layer_ids
        self.k = draft_tokens
        self.max_new_tokens = max_new_tokens
        self.eos = self.tokenizer.eos_token_id

    def _target(self, ids: list[int]):
        """The target's greedy tokens and EAGLE-3 aux hidden states (each aux layer's output) at every position."""
        import torch

        # A forward hook on each aux layer: transformers' output_hidden_states gives the last layer's output after
        # the final norm, not the layer's own output.
        captured = {}
        layers = self.target.model.layers
        hooks = [layers[i].register_forward_hook(lambda _m, _a, out, i=i: captured.__setitem__(
            i, out[0] if isinstance(out, tuple) else out)) for i in self.aux_layer_ids]
        try:
            logits = self.target(input_ids=torch.tensor([ids])).logits
        finally:
            for hook in hooks:
                hook.remove()
        return logits[0].argmax(-1).tolist(), torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)

    def _propose(self, draft, token_map, context: list[int], aux, bonus: int) -> list[int]:
        """``k`` draft tokens after ``context + [bonus]``: the draft's step ``s`` reads its step ``s - 1`` output at
        the last slot and its own previous proposal (slot ``j`` pairs the target state at ``j`` with token ``j+1``)."""
        import torch

        ids = torch.tensor([context[1:] + [bonus]])
        mask = torch.ones_like(ids)
        hidden = draft.project_hidden_states(aux[:, : len(context)])
        cache_hidden: list[list] = [[], []]
        proposals = []
        for _ in range(self.k):
            hidden = draft(input_ids=ids, projected_hidden_states=hidden, attention_mask=mask,
                           cache_hidden=cache_hidden)
            token = int(token_map[draft.compute_logits(hidden)[0, -1].argmax()])
            proposals.append(token)
            ids = torch.cat([ids[:, 1:], torch.tensor([[token]])], dim=1)
        return proposals

    def decode_turn(self, draft, token_map, prompt: list[int]) -> tuple[list[int], list[int]]:
        """The greedy answer to ``prompt`` and the tokens each verification forward produced."""
        greedy, aux = self._target(prompt)
        context, bonus, generated, per_step = list(prompt), greedy[-1], [greedy[-1]], []
        while generated[-1] != self.eos and len(generated) < self.max_new_tokens:
            proposals = self._propose(draft, token_map, context, aux, bonus)
            greedy, aux = self._target(context + [bonus] + proposals)
            checked = greedy[len(context):]  # checked[i]: the target's token after bonus + proposals[:i]
            accepted = 0
            while accepted < self.k and proposals[accepted] == checked[accepted]:
                accepted += 1
            new = proposals[:accepted] + [checked[accepted]]
            room = self.max_new_tokens - len(generated)
            if self.eos in new:
                new = new[: new.index(self.eos) + 1]
            new = new[:room]
            context, bonus = context + [bonus] + proposals[:accepted], checked[accepted]
            generated += new
            per_step.append(len(new))
        return generated, per_step

    def every_position(self, draft, token_map, prompt: list[int], generated: list[int], hits: list, valid: list):
        """NeMo's estimate, from real proposals: from every position of the greedy answer (not only where the decoder
        verified), whether the first ``d`` proposals are the target's next ``d`` tokens (counted where the answer
        has ``d`` more tokens), summed into ``hits[d-1]`` / ``valid[d-1]``."""
        _, aux = self._target(prompt + generated)
        for anchor in range(len(generated) - 1):
            proposals = self._propose(draft, token_map, prompt + generated[:anchor], aux, generated[anchor])
            for depth in range(1, self.k + 1):
                if anchor + depth >= len(generated):
                    break
                valid[depth - 1] += 1
                hits[depth - 1] += proposals[:depth] == generated[anchor + 1: anchor + 1 + depth]

    def tau(self, draft, token_map, rows: list[dict]) -> dict:
        import torch

        steps, tokens, turns, equal = 0, 0, 0, 0
        hits, valid = [0] * self.k, [0] * self.k
        draft.eval()
        with torch.no_grad():
            for row in rows:
                messages = row["messages"]
                for index, message in enumerate(messages):
                    if message["role"] != "assistant":
                        continue
                    prompt = self.tokenizer.apply_chat_template(messages[:index], tokenize=True,
                                                                add_generation_prompt=True, return_dict=False)
                    whole = self.tokenizer.apply_chat_template(messages[: index + 1], tokenize=True,
                                                               return_dict=False)
                    generated, per_step = self.decode_turn(draft, token_map, prompt)
                    self.every_position(draft, token_map, prompt, generated, hits, valid)
                    steps, tokens, turns = steps + len(per_step), tokens + sum(per_step), turns + 1
                    # The regenerated turn as the template renders it ends "<|im_end|>\n"; a cut one, mid-answer.
                    equal += whole[len(prompt): len(prompt) + len(generated)] == generated
        every = 1 + sum(hit / max(count, 1) for hit, count in zip(hits, valid))
        return {"tau": tokens / max(steps, 1), "verification_steps": steps, "turns": turns,
                "decoder_turns_equal": equal, "tau_every_position": round(every, 4)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--cache", help="a ds_capture EAGLE-3 cache to train from (cached_target_path)")
    parser.add_argument("--remote-url", help="a running ds-capture serve to train against (remote backend)")
    parser.add_argument("--data", help="the training rows (JSONL) for the remote backend")
    parser.add_argument("--heldout-cache", required=True)
    parser.add_argument("--heldout-data", required=True, help="regenerated held-out rows (JSONL), for the decoder")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, default=[1, 2, 3])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--decode-untrained", action="store_true", help="also decode with the untrained drafter")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if bool(args.cache) == bool(args.remote_url) or (args.remote_url and not args.data):
        parser.error("give --cache, or --remote-url with --data")

    started = time.perf_counter()
    single_process_env()
    import torch
    import nemo_automodel.recipes.llm.train_eagle3 as train_eagle3
    from nemo_automodel.components.config.loader import ConfigNode

    rows = [json.loads(line) for line in Path(args.heldout_data).read_text().splitlines() if line.strip()]
    decoder = SpeculativeDecoder(args.target, args.aux_layer_ids, args.draft_tokens, args.max_new_tokens)
    result: dict = {"backend": "remote" if args.remote_url else "cache", "curve": []}
    with tempfile.TemporaryDirectory() as out_dir:
        torch.manual_seed(args.seed)
        recipe = train_eagle3.TrainEagle3Recipe(ConfigNode(recipe_config(args, out_dir)))
        recipe.setup()
        recipe.train_dataloader = _fixed_order(recipe.train_dataloader, args.seed)
        trainer = recipe._module()
        token_map = trainer.selected_token_ids
        result["setup_seconds"] = round(time.perf_counter() - started, 1)

        def evaluate(step: int) -> None:
            result["curve"].append({"step": step, "nemo": round(nemo_tau(trainer, args.heldout_cache,
                                                                         args.batch_size), 4)})

        evaluate(0)
        if args.decode_untrained:
            result["untrained"] = {"nemo": result["curve"][0]["nemo"], **decoder.tau(trainer.draft_model,
                                                                                   token_map, rows)}
        after_step = recipe._maybe_save_step_checkpoint

        def after_each_step(epoch):
            saved = after_step(epoch)
            if recipe.runtime.global_step % args.eval_every == 0:
                evaluate(recipe.runtime.global_step)
            return saved

        recipe._maybe_save_step_checkpoint = after_each_step
        losses = []
        forward = recipe._forward_batch

        def recording(batch, target_batch=None):
            metrics = forward(batch, target_batch)
            losses.append(float(metrics.loss.detach()))
            return metrics

        recipe._forward_batch = recording
        trained = time.perf_counter()
        recipe.run_train_validation_loop()
        result["train_seconds"] = round(time.perf_counter() - trained, 1)
        steps = recipe.runtime.global_step
        if result["curve"][-1]["step"] != steps:
            evaluate(steps)
        result.update(steps=steps, first_loss=losses[0], last_loss=losses[-1],
                      trained={"nemo": result["curve"][-1]["nemo"], **decoder.tau(trainer.draft_model, token_map,
                                                                                   rows)})
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    result["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result)
    if args.out:
        args.out.write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
