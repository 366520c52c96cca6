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

Tau, at 0 steps (untrained, with ``--untrained``), every ``--eval-every`` optimizer steps and at the end, both
measured on the same held-out rows (the regenerated ones: the target's own greedy answers) and reduced the same way
(1 + the sum over depths ``d`` of hits / counted chains):
- ``nemo`` (method a): NeMo's ``simulated_accept_length`` over the held-out cache: the trainer module's own forward
  (its ``ttt_steps`` = the draft tokens, the test-time-training unroll, teacher-forced) on every held-out row,
  prefix hits and valid chains summed, as ``TrainEagle3Recipe._run_eval`` sums them;
- ``decoder`` (method b, untrained and final only): a greedy speculative decoder of its own, verifying from every
  position. The held-out rows are tokenized by ds_capture's data stage (``heldout_rows_in_cache``: how many the
  cache holds with exactly those tokens and loss masks); one transformers forward of the target (its own class, fp32) gives its greedy tokens and
  the aux states (forward hooks); from each anchor, the drafter proposes ``k`` tokens as a decoder does (each from
  its own previous proposal, not from the row's next token), and the target's greedy continuation from that anchor
  (the row's own forward while the row follows it, a forward of its own where it does not) accepts the longest
  matching prefix. A depth counts where the cache supervises it (NeMo's ``step_valid``). All anchors of a row are
  drafted in one batched unroll; ``proposal_checks`` compares sampled anchors with a one-anchor decoder call.
- ``free_running`` (``--free-running``): the same drafter decoding every held-out turn from its prompt, generated
  tokens per verification forward. It measures something else: a decoder drafts only from the positions it
  reaches, and after a rejection it resumes where the drafter was wrong, the harder positions, so it sits below
  the every-position figures (by 0.4 on the recorded run before this one).

Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # ds_capture's data stage tokenizes the held-out rows for the decoder
sys.path.insert(0, str(ROOT / "tools" / "nemo_oracle"))
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
                       "remote_urls": [args.remote_url], "remote_timeout": 120, "remote_max_retries": 0,
                       # the next batch's request in flight while this one trains (same batches, same order)
                       "target_prefetch_depth": 1})
    return {"recipe_args": recipe, "dist_env": {"backend": "gloo", "timeout_minutes": 5},
            "optimizer": {"lr": args.lr, "warmup_ratio": 0.05}, "checkpoint": {"enabled": False}}


def _fixed_order(loader, seed: int):
    """``loader`` again, drawing its batches in an order fixed by ``seed`` (the same for any dataset length)."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    sampler = RandomSampler(loader.dataset, generator=torch.Generator().manual_seed(seed))
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn,
                      num_workers=0, drop_last=False)


def nemo_tau(trainer_module, heldout_cache: str, batch_size: int) -> dict:
    """NeMo's simulated accept length over every row of the held-out cache (as ``_run_eval`` sums its windows),
    with its per-depth chain hits and counted chains."""
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
    return {"tau": float(simulated_accept_length(hits, valid)), "hits": [int(h) for h in hits.tolist()],
            "valid": [int(v) for v in valid.tolist()]}


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
        self._greedy_after: dict[tuple, int] = {}  # the target's greedy token after a token sequence (memo)

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

    def _propose_everywhere(self, draft, token_map, ids: list[int], aux) -> list[list[int]]:
        """``_propose`` from every anchor of a row at once: row ``t`` of the result holds the ``k`` proposals after
        context ``ids[:t+1]`` and bonus ``ids[t+1]``. The draft attends causally to the step-0 keys and, at later
        steps, only to its own slot's earlier keys, so slot ``t`` fed its own previous proposal computes what
        ``_propose`` computes at the last slot (checked on sampled anchors: ``proposal_checks``)."""
        import torch

        inputs = torch.tensor([ids[1:]])
        mask = torch.ones_like(inputs)
        hidden = draft.project_hidden_states(aux[:, : len(ids) - 1])
        cache_hidden: list[list] = [[], []]
        steps = []
        for _ in range(self.k):
            hidden = draft(input_ids=inputs, projected_hidden_states=hidden, attention_mask=mask,
                           cache_hidden=cache_hidden)
            inputs = token_map[draft.compute_logits(hidden)[0].argmax(-1)].unsqueeze(0)
            steps.append(inputs[0])
        return torch.stack(steps, dim=1).tolist()

    def _continuation(self, ids: list[int], anchor: int, greedy: list[int], depth: int) -> list[int]:
        """The target's greedy ``depth`` tokens after ``ids[:anchor+2]``: what a verification forward of the target
        returns. From the row's own forward while the row follows them; a forward of its own where it does not."""
        tokens = [greedy[anchor + 1]]
        while len(tokens) < depth:
            at = anchor + 1 + len(tokens)
            if tokens == ids[anchor + 2: at + 1] and at < len(greedy):
                tokens.append(greedy[at])
                continue
            prefix = tuple(ids[: anchor + 2] + tokens)
            if prefix not in self._greedy_after:
                self._greedy_after[prefix] = self._target(list(prefix))[0][-1]
            tokens.append(self._greedy_after[prefix])
        return tokens

    def verify_every_position(self, draft, token_map, rows: list[tuple[list[int], list[int]]]) -> dict:
        """Tau from every position of the held-out rows (method b). ``rows``: each row's content tokens ``x`` and
        loss mask ``m`` as the cache's tokenization gives them. Anchor ``t`` (context ``x[:t+1]``, bonus
        ``x[t+1]``): the drafter proposes ``k`` tokens, its own chain; the target's greedy continuation verifies
        them; depth ``d`` counts where ``m[t+1..t+d]`` are all 1 (the cache's supervised slots, NeMo's
        ``step_valid``), a hit where the first ``d`` proposals are the target's. Reduced as NeMo reduces:
        1 + sum over depths of hits / counted."""
        import torch

        hits, valid = [0] * self.k, [0] * self.k
        anchors = off_path = checked = equal = 0
        draft.eval()
        with torch.no_grad():
            for number, (ids, mask) in enumerate(rows):
                greedy, aux = self._target(ids)
                proposals = self._propose_everywhere(draft, token_map, ids, aux)
                for anchor in range(len(ids) - 1):
                    depth = 0
                    while depth < self.k and anchor + depth + 1 < len(ids) and mask[anchor + depth + 1]:
                        depth += 1
                    if not depth:
                        continue
                    anchors += 1
                    accepted = 0
                    while accepted < depth and proposals[anchor][: accepted + 1] == self._continuation(
                            ids, anchor, greedy, accepted + 1):
                        accepted += 1
                    off_path += greedy[anchor + 1: anchor + depth] != ids[anchor + 2: anchor + depth + 1]
                    for d in range(depth):
                        valid[d] += 1
                        hits[d] += accepted > d
                    if number == 0 and anchor % 8 == 0:  # the batched proposals against the one-anchor decoder
                        checked += 1
                        equal += self._propose(draft, token_map, ids[: anchor + 1], aux, ids[anchor + 1]) \
                            == proposals[anchor]
        return {"tau": 1 + sum(hit / max(count, 1) for hit, count in zip(hits, valid)), "hits": hits,
                "valid": valid, "anchors": anchors, "anchors_off_greedy_path": off_path,
                "proposal_checks": [equal, checked]}

    def decode_turn(self, draft, token_map, prompt: list[int]) -> tuple[list[int], list[int]]:
        """Free-running: the greedy answer to ``prompt`` and the tokens each verification forward produced."""
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

    def free_running(self, draft, token_map, conversations: list[dict]) -> dict:
        """Free-running decoding of every assistant turn of the held-out rows from the conversation before it:
        generated tokens per verification forward, up to the end-of-turn token or ``max_new_tokens``."""
        import torch

        steps, tokens, turns, equal = 0, 0, 0, 0
        draft.eval()
        with torch.no_grad():
            for row in conversations:
                messages = row["messages"]
                for index, message in enumerate(messages):
                    if message["role"] != "assistant":
                        continue
                    prompt = self.tokenizer.apply_chat_template(messages[:index], tokenize=True,
                                                                add_generation_prompt=True, return_dict=False)
                    whole = self.tokenizer.apply_chat_template(messages[: index + 1], tokenize=True,
                                                               return_dict=False)
                    generated, per_step = self.decode_turn(draft, token_map, prompt)
                    steps, tokens, turns = steps + len(per_step), tokens + sum(per_step), turns + 1
                    # The regenerated turn as the template renders it ends "<|im_end|>\n"; a cut one, mid-answer.
                    equal += whole[len(prompt): len(prompt) + len(generated)] == generated
        return {"tau": round(tokens / max(steps, 1), 4), "verification_steps": steps, "turns": turns,
                "decoder_turns_equal": equal}


def heldout_tokens(target: str, heldout_data: str, seq_length: int) -> list:
    """The held-out rows as the cache's tokenization gives them (ds_capture's data stage, which reproduces NeMo's
    dataset; before NeMo's import, as ``ds-capture run`` loads the tokenizer): content tokens and loss mask."""
    import transformers

    from ds_capture.data.tokenization import read_conversations, resolve_chat_template, tokenize_conversations

    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    tokenized = tokenize_conversations(read_conversations(heldout_data, split=None, shuffle_seed=42), tokenizer,
                                       chat_template=resolve_chat_template(tokenizer, None), seq_length=seq_length,
                                       mask_reasoning_content=False, mask_generation_prompt=False)
    return [(tokenized.input_ids[i, :n].tolist(), tokenized.loss_mask[i, :n].tolist())
            for i, n in enumerate(tokenized.num_tokens.tolist())]


def rows_in_cache(rows: list, heldout_cache: str) -> list[int]:
    """[rows whose tokens and loss mask the cache holds (shifted left by one, as it stores them), rows]."""
    from nemo_automodel.components.datasets.llm.eagle3_cache import build_cached_eagle3_dataloader

    cached = [(ids.tolist(), mask.tolist()) for batch in build_cached_eagle3_dataloader(
        cache_dir=heldout_cache, batch_size=1, shuffle=False) for ids, mask in zip(batch["input_ids"],
                                                                                    batch["loss_mask"])]
    equal = sum(cached_ids[: len(ids) - 1] == ids[1:] and cached_mask[: len(ids) - 1] == mask[1:]
                and not any(cached_mask[len(ids) - 1:]) for (ids, mask), (cached_ids, cached_mask) in zip(rows, cached))
    return [equal, max(len(rows), len(cached))]


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
    parser.add_argument("--untrained", action="store_true", help="also measure the untrained drafter")
    parser.add_argument("--free-running", action="store_true",
                        help="also decode every held-out turn free-running (tokens per verification forward)")
    parser.add_argument("--no-decoder", action="store_true", help="NeMo's figure only (for quick sweeps)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if bool(args.cache) == bool(args.remote_url) or (args.remote_url and not args.data):
        parser.error("give --cache, or --remote-url with --data")

    started = time.perf_counter()
    rows = heldout_tokens(args.target, args.heldout_data, args.seq_length)
    single_process_env()
    import torch
    import nemo_automodel.recipes.llm.train_eagle3 as train_eagle3
    from nemo_automodel.components.config.loader import ConfigNode

    conversations = [json.loads(line) for line in Path(args.heldout_data).read_text().splitlines() if line.strip()]
    decoder = SpeculativeDecoder(args.target, args.aux_layer_ids, args.draft_tokens, args.max_new_tokens)
    result: dict = {"backend": "remote" if args.remote_url else "cache", "curve": [],
                    "heldout_rows_in_cache": rows_in_cache(rows, args.heldout_cache)}
    seconds = {"eval": 0.0, "decoder": 0.0}

    def measure(draft, token_map) -> dict:
        if args.no_decoder:
            return {}
        since = time.perf_counter()
        measured = {"decoder": decoder.verify_every_position(draft, token_map, rows)}
        if args.free_running:
            measured["free_running"] = decoder.free_running(draft, token_map, conversations)
        seconds["decoder"] += time.perf_counter() - since
        return measured

    with tempfile.TemporaryDirectory() as out_dir:
        torch.manual_seed(args.seed)
        recipe = train_eagle3.TrainEagle3Recipe(ConfigNode(recipe_config(args, out_dir)))
        recipe.setup()
        recipe.train_dataloader = _fixed_order(recipe.train_dataloader, args.seed)
        trainer = recipe._module()
        token_map = trainer.selected_token_ids
        seconds["setup"] = time.perf_counter() - started
        nemo: dict = {}

        def evaluate(step: int) -> None:
            since = time.perf_counter()
            nemo.update(nemo_tau(trainer, args.heldout_cache, args.batch_size))
            result["curve"].append({"step": step, "nemo": round(nemo["tau"], 4)})
            seconds["eval"] += time.perf_counter() - since

        evaluate(0)
        if args.untrained:
            result["untrained"] = {"nemo": dict(nemo), **measure(trainer.draft_model, token_map)}
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
        eval_before = seconds["eval"]
        recipe.run_train_validation_loop()
        seconds["train"] = time.perf_counter() - trained - (seconds["eval"] - eval_before)
        steps = recipe.runtime.global_step
        if result["curve"][-1]["step"] != steps:
            evaluate(steps)
        result.update(steps=steps, first_loss=losses[0], last_loss=losses[-1],
                      trained={"nemo": dict(nemo), **measure(trainer.draft_model, token_map)})
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    seconds["total"] = time.perf_counter() - started
    result["seconds"] = {key: round(value, 1) for key, value in seconds.items()}
    text = json.dumps(result)
    if args.out:
        args.out.write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
