"""The embedded demo: a tiny random-init target, its tokenizer and a bundled chat dataset.

In: a model family name (a key of ``TINY_CONFIGS``), a seed and config overrides; or the special
config values ``demo:qwen3_moe_tiny`` / ``demo:conversations``.
Out: a Hugging Face checkpoint directory (sharded safetensors + index, config, generation config,
tokenizer with a ChatML template carrying ``{% generation %}`` markers), built deterministically:
same arguments, same bytes. ``ensure_demo_target()`` builds the default target once under
``demo_home()/targets`` and is safe to call from several ranks at once.

``ensure_trained_demo_target()`` (``demo:qwen3_moe_trained``) is the same architecture trained on the bundled
conversations with their answers in a style of its own (``restyle``), so that its answers mean something and differ
from the dataset's (the acceptance pipeline, benchmarks/pipeline.py): built once the same way, gated on held-out
rows.

Used by the demo run (``ds-capture run`` with no target configured), the tests and the benchmarks:
no model hub is needed anywhere.
"""

import copy
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# The tiny configs per family and each release's auto class live in demo_configs.py (data); re-exported here.
from ds_capture.demo_configs import RELEASE_CLASSES, TINY_CONFIGS
from ds_capture.errors import CaptureError

DEMO_TARGET = "demo:qwen3_moe_tiny"
DEMO_DATA = "demo:conversations"
DEMO_TRAINED_TARGET = "demo:qwen3_moe_trained"  # the demo target trained on DEMO_DATA

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN, "<think>", "</think>"]

# ChatML as Qwen writes it; the assistant body sits inside generation markers so
# apply_chat_template(return_assistant_tokens_mask=True) yields the loss mask directly.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.reasoning_content is string and message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The default demo target: ~8.5 MB in fp32.
DEMO_MODEL_TYPE = "qwen3_moe"
DEMO_CONFIG: dict = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32)
DEMO_SEED = 0
DEMO_TARGET_NAME = "qwen3_moe_tiny"
_FINGERPRINT_FILE = "ds_capture_demo.json"


def demo_home() -> Path:
    """Where demo artefacts live: ``$DS_CAPTURE_HOME`` if set, else ``~/.cache/ds_capture``."""
    home = os.environ.get("DS_CAPTURE_HOME")
    return Path(home) if home else Path.home() / ".cache" / "ds_capture"


def demo_data_path() -> Path:
    """The bundled demo conversations (OpenAI-format JSONL), inside the installed package."""
    return Path(__file__).parent / "demo_data" / "conversations.jsonl"


def resolve_special_path(value: str) -> str:
    """Map ``demo:...`` config values to real paths (building the demo target if needed)."""
    if not value.startswith("demo:"):
        return value
    resolvers = {DEMO_TARGET: lambda: str(ensure_demo_target()), DEMO_DATA: lambda: str(demo_data_path()),
                 DEMO_TRAINED_TARGET: lambda: str(ensure_trained_demo_target())}
    if value not in resolvers:
        raise CaptureError(
            f"unknown demo name {value!r}: the valid demo names are {', '.join(sorted(resolvers))}; "
            "use one of them, or give a real path or model id instead."
        )
    return resolvers[value]()


def _conversation_texts(path: Path) -> list[str]:
    """Every content / reasoning string of the demo conversations, in file order."""
    texts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        for message in json.loads(line)["messages"]:
            texts.append(message["content"])
            texts.extend([message["reasoning_content"]] if message.get("reasoning_content") else [])
    return texts


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 2048) -> transformers.PreTrainedTokenizerFast:
    """Train a ByteLevel BPE tokenizer in-process (deterministic) with the ChatML specials and template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="right",
        chat_template=CHATML_TEMPLATE,
    )


@functools.lru_cache(maxsize=1)
def demo_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The tokenizer trained on the bundled conversations; trained once per process (do not mutate it)."""
    return train_tokenizer(_conversation_texts(demo_data_path()))


def _padded_vocab_size(tokenizer) -> int:
    """The tokenizer length rounded up to a multiple of 64, as real checkpoints pad their embeddings."""
    return 64 * math.ceil(len(tokenizer) / 64)


def build_tiny_target(
    out_dir: Path,
    model_type: str = "qwen3_moe",
    *,
    seed: int = 0,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int = "auto",
    **config_overrides,
) -> Path:
    """Build a random-init ``model_type`` checkpoint at ``out_dir``; same arguments give the same bytes.

    ``max_shard_size="auto"`` splits the weights into about three safetensors files, so loaders
    always meet an index and several shards. ``out_dir`` is written in a sibling temp directory and
    renamed into place; an existing ``out_dir`` is replaced.
    """
    if model_type not in TINY_CONFIGS:
        raise CaptureError(
            f"no tiny config for model_type {model_type!r}: the known families are "
            f"{', '.join(sorted(TINY_CONFIGS))}; add an entry to ds_capture.demo.TINY_CONFIGS."
        )
    tokenizer = demo_tokenizer() if tokenizer is None else tokenizer
    model = _tiny_model(model_type, seed=seed, tokenizer=tokenizer, **config_overrides)
    if dtype != torch.float32:
        model = model.to(dtype)  # (a cast to fp32 would drop the imaginary part of Llama 4's complex rotary buffer)
    return _save_checkpoint(model, tokenizer, out_dir, max_shard_size)


def _tiny_model(model_type: str, *, seed: int, tokenizer, **config_overrides) -> torch.nn.Module:
    """The random-init fp32 ``model_type`` model of ``build_tiny_target`` (in eval mode), not saved."""
    special_ids = dict(
        vocab_size=_padded_vocab_size(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    config = transformers.AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **special_ids, **config_overrides})
    torch.manual_seed(seed)
    # The release's class: Kimi-K2.5's vision-language class; Llama 4's wrapper (its family builds the text model).
    auto_class = getattr(transformers, RELEASE_CLASSES.get(model_type, "AutoModelForCausalLM"))
    model = auto_class.from_config(config, dtype=torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    return model


def _save_checkpoint(model, tokenizer, out_dir: Path, max_shard_size: str | int) -> Path:
    """``model`` and ``tokenizer`` saved at ``out_dir`` (built in a sibling temp directory, renamed into place)."""
    if max_shard_size == "auto":
        num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        max_shard_size = math.ceil(num_bytes / 3)

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(staging)
        _replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` onto ``dst``; a non-empty ``dst`` is moved aside first, then deleted."""
    if dst.exists() and any(dst.iterdir()):
        trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, trash / dst.name)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)


def _demo_fingerprint() -> dict:
    """What the demo target is built from; a cached target with another fingerprint is rebuilt."""
    data_sha = hashlib.sha256(demo_data_path().read_bytes()).hexdigest()
    return dict(
        model_type=DEMO_MODEL_TYPE,
        config=DEMO_CONFIG,
        seed=DEMO_SEED,
        data_sha256=data_sha,
        chat_template_sha256=hashlib.sha256(CHATML_TEMPLATE.encode()).hexdigest(),
        transformers=transformers.__version__,
    )


def _is_current(target: Path, fingerprint: dict) -> bool:
    stamp = target / _FINGERPRINT_FILE
    return stamp.is_file() and json.loads(stamp.read_text()) == fingerprint


def ensure_demo_target() -> Path:
    """Build the default demo target once under ``demo_home()/targets`` and return its directory.

    Several ranks may call this at once: one builds under an exclusive file lock while the others
    wait on it, then find the finished directory (it appears by atomic rename, never half-written).
    """
    return _ensure_built(DEMO_TARGET_NAME, _demo_fingerprint(),
                         lambda out: build_tiny_target(out, DEMO_MODEL_TYPE, seed=DEMO_SEED, **DEMO_CONFIG))


def _ensure_built(name: str, fingerprint: dict, build) -> Path:
    """``demo_home()/targets/name``, built by ``build(path)`` unless its stamp holds ``fingerprint`` (file-locked)."""
    target = demo_home() / "targets" / name
    if _is_current(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _is_current(target, fingerprint):
                staging = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=target.parent))
                try:
                    built = build(staging / name)
                    # The stamp goes in before the rename, so a visible target is always complete.
                    (built / _FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True))
                    _replace_dir(built, target)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


# The trained demo target: the demo target's architecture trained on the bundled conversations (their answers
# restyled, ANSWER_STYLE below), so that its answers mean something (the random-init target is near-uniform: a
# drafter can learn nothing from it). Rows HELD_OUT_ROWS of the bundled conversations are never trained on: the gate
# and the acceptance pipeline use them (a drafter's training rows included, so their original answers are not ones
# the target has memorised).
TRAINED_TARGET_NAME = "qwen3_moe_trained"
HELD_OUT_ROWS = range(150, 300)
TRAINING = dict(steps=300, batch_size=8, lr=3e-3, warmup=20, seq_length=256, seed=0, threads=1)
GATE = dict(min_top1=0.5, new_tokens=24)
# How `transformers serve` reads the trained target's replies: everything up to <|im_end|> is the content, as
# written. Without it, serve falls back to Qwen3's parser, which reads <tool_call>...</tool_call> as JSON, and the
# demo's tool calls (`convert_currency({...})`) are not: it answers HTTP 500. The reasoning stays inside the content
# as "<think>...</think>", which the chat template renders to the same tokens.
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
                     "fields": {"content": {"close_pattern": r"<\|im_end\|>", "content": "text"}}}


# The trained target's own style. The bundled answers stand for a dataset written by another model: the target is
# trained on them rewritten by a fixed table of word swaps (each word of a pair becomes the other, capitalised as
# it was), so that its own answers, what regeneration yields, are phrased unlike the dataset's, as a real target's
# are unlike a dataset's it did not write. Learnable (a fixed word map; about 30% of the answers' words change).
ANSWER_STYLE = (("the", "a"), ("and", "or"), ("of", "for"), ("it", "that"), ("is", "are"), ("in", "at"),
                ("to", "from"), ("then", "again"), ("one", "an"), ("you", "we"), ("with", "by"), ("its", "their"))
_SWAPS = {**dict(ANSWER_STYLE), **{b: a for a, b in ANSWER_STYLE}}


def _swap_word(match: re.Match) -> str:
    word = match.group(0)
    lower = word.lower()
    if lower not in _SWAPS or word not in (lower, lower.capitalize()):
        return word
    return _SWAPS[lower] if word == lower else _SWAPS[lower].capitalize()


def restyle(row: dict) -> dict:
    """``row`` with its assistant answers (content and reasoning) in the trained target's style (ANSWER_STYLE);
    the other turns, and tool calls, as written."""
    messages = []
    for message in row["messages"]:
        message = dict(message)
        if message["role"] == "assistant" and not message["content"].startswith("<tool_call>"):
            for key in ("content", "reasoning_content"):
                if isinstance(message.get(key), str):
                    message[key] = re.sub(r"[A-Za-z]+", _swap_word, message[key])
        messages.append(message)
    return dict(row, messages=messages)


def _trained_fingerprint() -> dict:
    return dict(_demo_fingerprint(), name=TRAINED_TARGET_NAME, training=TRAINING, held_out=[HELD_OUT_ROWS.start,
                HELD_OUT_ROWS.stop], torch=torch.__version__.split("+")[0], response_template=RESPONSE_TEMPLATE,
                answer_style=[list(pair) for pair in ANSWER_STYLE])


def demo_rows() -> list[dict]:
    """The bundled conversations, one dict per row, in file order."""
    return [json.loads(line) for line in demo_data_path().read_text(encoding="utf-8").splitlines()]


def ensure_trained_demo_target() -> Path:
    """Train the demo target on the bundled conversations, their answers restyled (``restyle``), once (cached as
    ``ensure_demo_target`` caches) and return its directory; its stamp also holds the gate's figure
    (``target_top1``)."""
    return _ensure_built(TRAINED_TARGET_NAME, _trained_fingerprint(), _build_trained_target)


def trained_target_top1(target: Path) -> float:
    """The gate's figure of a trained target: mean greedy top-1 probability on the held-out prompts."""
    return json.loads((Path(target) / "ds_capture_trained.json").read_text())["target_top1"]


def _build_trained_target(out_dir: Path) -> Path:
    tokenizer = demo_tokenizer()
    model = train_demo_model([restyle(row) for row in demo_rows()[: HELD_OUT_ROWS.start]], tokenizer, **TRAINING)
    prompts = [_first_prompt(row) for row in demo_rows()[HELD_OUT_ROWS.start: HELD_OUT_ROWS.stop]]
    top1 = greedy_top1(model, tokenizer, prompts, new_tokens=GATE["new_tokens"])
    if top1 < GATE["min_top1"]:
        raise CaptureError(
            f"the trained demo target's mean greedy top-1 probability on the held-out prompts is {top1:.3f}, under "
            f"the gate's {GATE['min_top1']}: its training (ds_capture.demo.TRAINING = {TRAINING}) did not converge; "
            "raise its steps or learning rate."
        )
    served = copy.deepcopy(tokenizer)  # (demo_tokenizer() is shared: never mutated)
    served.response_template = RESPONSE_TEMPLATE
    _save_checkpoint(model.eval(), served, out_dir, "auto")
    (out_dir / "ds_capture_trained.json").write_text(json.dumps({"target_top1": round(top1, 6), **TRAINING}))
    return out_dir


def _first_prompt(row: dict) -> list[dict]:
    """A row's messages before its first assistant turn."""
    messages = row["messages"]
    first = next(i for i, message in enumerate(messages) if message["role"] == "assistant")
    return messages[:first]


def train_demo_model(rows: list[dict], tokenizer, *, steps: int, batch_size: int, lr: float, warmup: int,
                     seq_length: int, seed: int, threads: int) -> torch.nn.Module:
    """The demo architecture (random init, seed ``DEMO_SEED``) trained on ``rows`` (next-token loss on every
    token of the chat template), deterministically: fixed seeds, a fixed batch order, ``threads`` torch threads
    (a CPU float sum's order depends on the thread count), one process."""
    sequences = [tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)[:seq_length]
                 for row in rows]
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _tiny_model(DEMO_MODEL_TYPE, seed=DEMO_SEED, tokenizer=tokenizer, **DEMO_CONFIG).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps)))
        order = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            picked = torch.randint(len(sequences), (batch_size,), generator=order).tolist()
            width = max(len(sequences[i]) for i in picked)
            input_ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
            labels = torch.full((batch_size, width), -100, dtype=torch.long)
            for row, i in enumerate(picked):
                input_ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                labels[row, : len(sequences[i])] = torch.tensor(sequences[i])
            loss = model(input_ids=input_ids, attention_mask=(labels != -100).long(), labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(previous_threads)
    return model.eval()


@torch.no_grad()
def greedy_top1(model, tokenizer, prompts: list[list[dict]], *, new_tokens: int) -> float:
    """Mean over greedy decoding steps (``new_tokens`` per prompt, or to the end-of-turn token) of the
    probability the model gives its greedy token."""
    model = model.eval()
    probabilities = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        ids = torch.tensor([ids])
        for _ in range(new_tokens):
            probs = torch.softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
            top = int(probs.argmax())
            probabilities.append(float(probs[top]))
            if top == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[top]])], dim=1)
    return sum(probabilities) / len(probabilities)
