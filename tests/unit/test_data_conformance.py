"""tokenize_conversations against NeMo AutoModel 0.7.0's reference caches (input_ids and loss_mask exact),
plus loss masks per template kind and flag, truncation, padding, and the chat-template helpers.

Uses the fixture's tokenizer (tests/fixtures/nemo_dspark_v1/target, checked in).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_capture.data.tokenization import (
    TokenizedRows,
    chat_template_sha256,
    pad_token_id,
    read_conversations,
    resolve_chat_template,
    tokenize_conversations,
)
from ds_capture.errors import CaptureError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_dspark_v1"


def _nemo_args(cache: str) -> list[str]:
    return json.loads((FIXTURES / f"{cache}.nemo_args.json").read_text())["argv"]


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURES / "target")


@pytest.fixture(scope="module")
def plain_template() -> str:
    """The fixture's marker-free override template (same text, no {% generation %})."""
    return _arg(_nemo_args("cache_bf16_plain_masked"), "--chat-template")


def _load_cache(cache: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    shards = sorted((FIXTURES / cache).glob("shard-*.safetensors"))
    loaded = [load_file(str(s)) for s in shards]
    return {key: torch.cat([s[key] for s in loaded]) for key in ("input_ids", "loss_mask")}


# ----------------------------------------------------------------------------- NeMo reference caches


@pytest.mark.parametrize("cache", ["cache_fp32", "cache_bf16_plain_masked"])
def test_reference_cache_ids_and_masks(tokenizer, cache):
    argv = _nemo_args(cache)
    manifest = json.loads((FIXTURES / cache / "manifest.json").read_text())
    template = resolve_chat_template(tokenizer, _arg(argv, "--chat-template"))
    assert chat_template_sha256(template) == manifest["chat_template_sha256"]

    conversations = read_conversations(str(FIXTURES / "data.jsonl"), split=None, shuffle_seed=manifest["shuffle_seed"])
    rows = tokenize_conversations(
        conversations,
        tokenizer,
        chat_template=template,
        seq_length=int(_arg(argv, "--seq-length")),
        mask_reasoning_content="--mask-reasoning-content" in argv,
        mask_generation_prompt="--mask-generation-prompt" in argv,
    )
    expected = _load_cache(cache)
    assert len(rows) == manifest["num_samples"] == 10
    assert rows.input_ids.dtype == rows.loss_mask.dtype == rows.num_tokens.dtype == torch.int64
    assert torch.equal(rows.input_ids, expected["input_ids"])
    assert torch.equal(rows.loss_mask, expected["loss_mask"])
    assert rows.num_tokens.tolist() == [28, 38, 48, 48, 33, 41, 35, 48, 26, 27]
    assert int(rows.loss_mask.sum()) == int(expected["loss_mask"].sum()) > 0


def test_plain_template_without_flags_differs_from_reference(tokenizer, plain_template):
    # Without mask_generation_prompt the marker-free path supervises "<|im_start|>assistant\n" too.
    conversations = read_conversations(str(FIXTURES / "data.jsonl"), split=None, shuffle_seed=42)
    rows = tokenize_conversations(
        conversations, tokenizer, chat_template=plain_template, seq_length=48,
        mask_reasoning_content=False, mask_generation_prompt=False,
    )
    expected = _load_cache("cache_bf16_plain_masked")["loss_mask"]
    assert int(rows.loss_mask.sum()) - int(expected.sum()) == 36


# ----------------------------------------------------------------------------- masks per template and flag

CONVERSATION = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "qso aq"},
    {"role": "assistant", "content": "fcrge fi!", "reasoning_content": "sgqx cwng"},
    {"role": "user", "content": "ercyiinm"},
    {"role": "assistant", "content": "zdalzpc"},
]
THINK = "<think>\nsgqx cwng\n</think>\n\n"
HEAD = "<|im_start|>assistant\n"


def _supervised_runs(tokenizer, rows: TokenizedRows, i: int = 0) -> list[str]:
    """Each contiguous run of loss_mask == 1, decoded."""
    runs, current = [], []
    for token, keep in zip(rows.input_ids[i].tolist(), rows.loss_mask[i].tolist()):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


@pytest.mark.parametrize(
    "kind, mask_reasoning, mask_prompt, expected",
    [
        ("markers", False, False, [THINK + "fcrge fi!<|im_end|>\n", "zdalzpc<|im_end|>\n"]),
        ("markers", False, True, [THINK + "fcrge fi!<|im_end|>\n", "zdalzpc<|im_end|>\n"]),
        ("markers", True, False, ["fcrge fi!<|im_end|>\n", "zdalzpc<|im_end|>\n"]),
        ("markers", True, True, ["fcrge fi!<|im_end|>\n", "zdalzpc<|im_end|>\n"]),
        ("plain", False, False, [HEAD + THINK + "fcrge fi!<|im_end|>\n", HEAD + "zdalzpc<|im_end|>\n"]),
        ("plain", False, True, [THINK + "fcrge fi!<|im_end|>\n", "zdalzpc<|im_end|>\n"]),
        ("plain", True, False, [HEAD, "fcrge fi!<|im_end|>\n", HEAD + "zdalzpc<|im_end|>\n"]),
        ("plain", True, True, ["fcrge fi!<|im_end|>\n", "zdalzpc<|im_end|>\n"]),
    ],
)
def test_loss_mask_per_template_and_flag(tokenizer, plain_template, kind, mask_reasoning, mask_prompt, expected):
    template = tokenizer.chat_template if kind == "markers" else plain_template
    rows = tokenize_conversations(
        [CONVERSATION], tokenizer, chat_template=template, seq_length=96,
        mask_reasoning_content=mask_reasoning, mask_generation_prompt=mask_prompt,
    )
    assert _supervised_runs(tokenizer, rows) == expected
    assert int(rows.num_tokens[0]) == 57


def test_row_without_assistant_is_kept_unsupervised_under_markers(tokenizer):
    rows = tokenize_conversations(
        [[{"role": "user", "content": "qe"}], CONVERSATION], tokenizer, chat_template=tokenizer.chat_template,
        seq_length=32, mask_reasoning_content=True, mask_generation_prompt=True,
    )
    assert len(rows) == 2
    assert rows.loss_mask[0].sum() == 0 and rows.num_tokens[0] == 7  # <|im_start|> user \n q e <|im_end|> \n
    assert rows.loss_mask[1].sum() > 0


def test_row_without_assistant_is_refused_without_markers(tokenizer, plain_template):
    # NeMo 0.7.0's _build_multiturn_assistant_mask asserts "At least one assistant message is required".
    with pytest.raises(CaptureError) as err:
        tokenize_conversations(
            [CONVERSATION, [{"role": "user", "content": "qe"}]], tokenizer, chat_template=plain_template,
            seq_length=32, mask_reasoning_content=False, mask_generation_prompt=False,
        )
    assert str(err.value) == (
        "conversation 2: the conversation has no assistant message, and the chat template has no "
        "{% generation %} markers, so NeMo AutoModel refuses to build its answer-only loss mask. Remove the row, "
        "or use a template with {% generation %}...{% endgeneration %} markers."
    )


def test_leading_assistant_turn_without_markers(tokenizer, plain_template):
    conversation = [{"role": "assistant", "content": "qe"}, {"role": "user", "content": "fi"}]
    rows = tokenize_conversations(
        [conversation], tokenizer, chat_template=plain_template, seq_length=24,
        mask_reasoning_content=False, mask_generation_prompt=True,
    )
    # The empty prefix has no generation prompt to strip (NeMo skips it): the header stays supervised.
    assert _supervised_runs(tokenizer, rows) == [HEAD + "qe<|im_end|>\n"]
    assert rows.loss_mask[0, 0] == 1


def test_template_that_rewrites_history_is_refused(tokenizer):
    template = (
        "{{- messages | length }}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content"
        " + '<|im_end|>\\n' }}{%- endfor %}"
    )
    conversation = [{"role": "user", "content": "qe"}, {"role": "assistant", "content": "fi"}]
    with pytest.raises(CaptureError) as err:
        tokenize_conversations(
            [CONVERSATION[1:3], conversation], tokenizer, chat_template=template, seq_length=24,
            mask_reasoning_content=False, mask_generation_prompt=False,
        )
    assert str(err.value) == (
        "conversation 1: rendering its first 1 message(s) alone does not reproduce the start of the whole "
        "rendered conversation: the chat template rewrites earlier turns from later ones (Qwen3's stock template "
        "drops the <think> blocks of earlier turns), so NeMo AutoModel refuses to find assistant spans from "
        "conversation prefixes. Set recipe_args.chat_template to a template that wraps assistant turns in "
        "{% generation %}...{% endgeneration %}, or to one that renders every turn the same whatever follows it."
    )


# ----------------------------------------------------------------------------- truncation and padding


@pytest.mark.parametrize("kind", ["markers", "plain"])
def test_truncation_keeps_the_first_s_tokens(tokenizer, plain_template, kind):
    template = tokenizer.chat_template if kind == "markers" else plain_template
    long = [{"role": "user", "content": "qe"}, {"role": "assistant", "content": "irujnkvs skl " * 20}]
    untruncated = tokenize_conversations(
        [long], tokenizer, chat_template=template, seq_length=512,
        mask_reasoning_content=False, mask_generation_prompt=True,
    )
    full_ids = tokenizer.apply_chat_template(long, chat_template=template, tokenize=True, return_dict=True)["input_ids"]
    assert int(untruncated.num_tokens[0]) == len(full_ids) > 40
    assert untruncated.input_ids[0, : len(full_ids)].tolist() == list(full_ids)

    rows = tokenize_conversations(
        [long], tokenizer, chat_template=template, seq_length=24,
        mask_reasoning_content=False, mask_generation_prompt=True,
    )
    assert rows.input_ids.shape == rows.loss_mask.shape == (1, 24)
    assert int(rows.num_tokens[0]) == 24
    assert rows.input_ids[0].tolist() == list(full_ids[:24])
    assert torch.equal(rows.loss_mask[0], untruncated.loss_mask[0, :24])
    assert rows.loss_mask[0, -1] == 1  # the cut assistant turn stays supervised up to S


def test_padding_is_right_side_pad_id_and_unsupervised(tokenizer):
    rows = tokenize_conversations(
        [CONVERSATION[1:3], CONVERSATION], tokenizer, chat_template=tokenizer.chat_template, seq_length=64,
        mask_reasoning_content=False, mask_generation_prompt=False,
    )
    assert pad_token_id(tokenizer) == tokenizer.pad_token_id == 363
    for i in range(len(rows)):
        n = int(rows.num_tokens[i])
        assert 0 < n < 64
        assert rows.input_ids[i, n:].eq(363).all() and rows.loss_mask[i, n:].eq(0).all()
        assert not rows.input_ids[i, :n].eq(363).any()
        assert rows.loss_mask[i, n - 1] == 1  # "\n" after <|im_end|> closes the generation span
    assert rows.num_tokens.tolist() == [34, 57]


def test_pad_token_id_is_nemos_pad_else_eos():
    """As NeMo 0.7.0 pads (run on the fixture tokenizer: pad None -> eos 365, pad 0 -> 0, pad 363 -> 363)."""
    assert pad_token_id(SimpleNamespace(pad_token_id=7, eos_token_id=2)) == 7
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    assert pad_token_id(SimpleNamespace(pad_token_id=0, eos_token_id=2)) == 0
    with pytest.raises(CaptureError) as caught:
        pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None), where="/m: the tokenizer")
    assert str(caught.value) == (
        "/m: the tokenizer has neither a pad token nor an eos token, so there is no id to pad rows with (NeMo "
        "AutoModel pads with the pad token, else eos, and refuses such a tokenizer too). Set `pad_token` or "
        "`eos_token` in the target's tokenizer_config.json.")


def test_a_tokenizer_without_pad_token_pads_with_eos_as_nemo(tokenizer):
    import copy

    probe = copy.deepcopy(tokenizer)
    probe.pad_token = None
    assert probe.pad_token_id is None and probe.eos_token_id == 365
    rows = tokenize_conversations([CONVERSATION[1:3]], probe, chat_template=probe.chat_template, seq_length=64,
                                  mask_reasoning_content=False, mask_generation_prompt=False)
    n = int(rows.num_tokens[0])
    assert n < 64 and rows.input_ids[0, n:].eq(365).all() and rows.loss_mask[0, n:].eq(0).all()


# ----------------------------------------------------------------------------- chat template helpers


def test_chat_template_sha256():
    assert chat_template_sha256(None) == hashlib.sha256(b"").hexdigest()
    assert chat_template_sha256("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert chat_template_sha256("{{ é }}") == hashlib.sha256("{{ é }}".encode("utf-8")).hexdigest()


def test_resolve_chat_template_sources(tmp_path):
    tok = SimpleNamespace(chat_template="{{ own }}", name_or_path="tiny")
    assert resolve_chat_template(tok, None) == "{{ own }}"
    assert resolve_chat_template(tok, "{% for m in messages %}{% endfor %}") == "{% for m in messages %}{% endfor %}"
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ from_file }}\n", encoding="utf-8")
    assert resolve_chat_template(tok, str(jinja)) == "{{ from_file }}\n"
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{{ from_json }}"}), encoding="utf-8")
    assert resolve_chat_template(tok, str(config)) == "{{ from_json }}"
    named = SimpleNamespace(chat_template={"tool_use": "{{ t }}", "default": "{{ d }}"}, name_or_path="tiny")
    assert resolve_chat_template(named, None) == "{{ d }}"


def test_resolve_chat_template_errors(tmp_path):
    with pytest.raises(CaptureError) as err:
        resolve_chat_template(SimpleNamespace(chat_template=None, name_or_path="tiny"), None)
    assert str(err.value) == (
        "the tokenizer of 'tiny' has no chat template. Set recipe_args.chat_template to a Jinja template or to "
        "a file holding one."
    )
    missing = str(tmp_path / "missing.jinja")
    with pytest.raises(CaptureError) as err:
        resolve_chat_template(SimpleNamespace(chat_template="{{ x }}"), missing)
    assert str(err.value) == (
        f"chat_template {missing!r} is neither an existing file nor a Jinja template (no '{{%' or '{{{{'). "
        "Fix the path, or give the template text itself."
    )


def test_fixture_template_file_resolves_to_the_tokenizer_template(tokenizer):
    from_file = resolve_chat_template(tokenizer, str(FIXTURES / "target" / "chat_template.jinja"))
    assert chat_template_sha256(from_file) == chat_template_sha256(resolve_chat_template(tokenizer, None))
