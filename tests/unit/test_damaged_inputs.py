"""Damaged and missing inputs: `ds-capture run` exits 2 with one paragraph naming the file (and row), no
traceback, and nothing written (the output directory is never created)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ds_capture.cli import main

GOOD_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture()
def target(tiny_target, tmp_path) -> Path:
    """A private copy of the tiny qwen3 target, free to damage."""
    copy = tmp_path / "target"
    shutil.copytree(tiny_target("qwen3"), copy)
    return copy


def run_and_expect(tmp_path, write_recipe, capsys, target, expected: str, *, rows=(GOOD_ROW, GOOD_ROW),
                   data: Path | None = None, **extra) -> None:
    if data is None:
        data = tmp_path / "data.jsonl"
        data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    out = tmp_path / "out"
    recipe = write_recipe({"recipe_args": dict(
        target_model_name_or_path=str(target), train_data_path=str(data), cache_output_dir=str(out),
        seq_length=32, micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32", **extra)})
    capsys.readouterr()
    assert main(["run", "-c", str(recipe), "--no-progress"]) == 2
    captured = capsys.readouterr()
    expected = expected.replace("{target}", str(target)).replace("{data}", str(data))
    assert captured.err == "ds-capture run: error: " + expected + "\n"
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()


def test_missing_target_directory(tmp_path, write_recipe, capsys):
    run_and_expect(tmp_path, write_recipe, capsys, tmp_path / "no-such-model",
                   "recipe_args.target_model_name_or_path: {target} does not exist. Point it at a local Hugging Face "
                   "checkpoint directory (config.json + *.safetensors + tokenizer files).")


def test_truncated_safetensors(target, tmp_path, write_recipe, capsys):
    shard = sorted(target.glob("model-*.safetensors"))[1]
    size = shard.stat().st_size
    with shard.open("r+b") as handle:
        handle.truncate(size - 100)
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   f"{shard}: the file is truncated ({size - 100:,} bytes; its header describes {size:,}). The "
                   "download or copy did not finish; fetch the file again.")


def test_safetensors_with_a_damaged_header(target, tmp_path, write_recipe, capsys):
    shard = sorted(target.glob("model-*.safetensors"))[0]
    shard.write_bytes(struct.pack("<Q", 12) + b'{"a": broken')
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   f"{shard}: not a readable safetensors file (Expecting value: line 1 column 7 (char 6); 20 bytes). "
                   "The file is damaged or was not fully written; fetch it again or re-save the target with "
                   "save_pretrained.")


def test_index_names_a_missing_shard(target, tmp_path, write_recipe, capsys):
    shard = sorted(target.glob("model-*.safetensors"))[2]
    shard.unlink()
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   f"{target / 'model.safetensors.index.json'} names 1 file(s) that do not exist ({shard.name}). The "
                   "checkpoint is incomplete; finish the download or copy of the target.")


def test_quantized_tensor_without_quantization_config(target, tmp_path, write_recipe, capsys):
    shard = sorted(target.glob("model-*.safetensors"))[-1]
    index = json.loads((target / "model.safetensors.index.json").read_text())
    key = next(k for k, v in index["weight_map"].items() if v == shard.name)
    save_file({key: torch.zeros(4, dtype=torch.int8)}, str(shard))
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   f"{shard}: tensor {key!r} is stored as I8, which is not a bf16 / fp16 / fp32 weight (8-bit and "
                   "4-bit storage means a quantized checkpoint). Convert the checkpoint to bf16 first and point "
                   "recipe_args.target_model_name_or_path at the converted directory.")


def test_no_tokenizer_files(target, tmp_path, write_recipe, capsys):
    (target / "tokenizer.json").unlink()
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   "{target}: no tokenizer files (looked for tokenizer.json, tokenizer.model, vocab.json, vocab.txt, "
                   "spiece.model, tiktoken.model). Copy the tokenizer files of the released model (tokenizer.json, "
                   "tokenizer_config.json, special_tokens_map.json) into the target directory.")


def test_damaged_tokenizer_file(target, tmp_path, write_recipe, capsys):
    (target / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(GOOD_ROW) + "\n")
    out = tmp_path / "out"
    recipe = write_recipe({"recipe_args": dict(
        target_model_name_or_path=str(target), train_data_path=str(data), cache_output_dir=str(out), seq_length=32)})
    capsys.readouterr()
    assert main(["run", "-c", str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ds-capture run: error: {target}: the tokenizer cannot be loaded from tokenizer.json (")
    assert err.endswith("). The files are damaged or incomplete. Copy the tokenizer files of the released model "
                        "(tokenizer.json, tokenizer_config.json, special_tokens_map.json) into the target directory.\n")
    assert not out.exists()


def test_tokenizer_larger_than_the_model_vocabulary(target, tmp_path, write_recipe, capsys):
    config = json.loads((target / "config.json").read_text())
    config["vocab_size"] = 40  # the demo tokenizer's byte tokens already reach past id 40
    (target / "config.json").write_text(json.dumps(config))
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   "{data} line 1: renders token id {token}, but the target's embedding has 40 rows (vocab_size in "
                   "{target}/config.json). The tokenizer does not belong to this model: use the model's own "
                   "tokenizer files.".replace("{token}", str(_first_id_at_least(target, 40))))


def _first_id_at_least(target: Path, vocab: int) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    ids = tokenizer.apply_chat_template(GOOD_ROW["messages"], tokenize=True, return_dict=True)["input_ids"]
    return next(i for i in ids if i >= vocab)


def test_undecodable_jsonl_bytes(target, tmp_path, write_recipe, capsys):
    data = tmp_path / "data.jsonl"
    good = (json.dumps(GOOD_ROW) + "\n").encode()
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'
    data.write_bytes(good + bad)
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   f"{{data}} line 2: not valid UTF-8 (byte 0xe9 at byte {len(good) + bad.index(0xe9)} of the file). "
                   "Datasets must be UTF-8 text; re-encode the file (e.g. iconv -f <encoding> -t utf-8) or delete "
                   "the line.", data=data)


def test_undecodable_json_list(target, tmp_path, write_recipe, capsys):
    data = tmp_path / "data.json"
    text = b'[\n{"messages": [{"role": "user", "content": "\xff"}]}]'
    data.write_bytes(text)
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   f"{{data}}: not valid UTF-8 (byte 0xff at byte {text.index(0xff)}, line 2). "
                   "Datasets must be UTF-8 text; re-encode the file (e.g. iconv -f <encoding> -t utf-8).", data=data)


def test_template_raise_exception_names_the_row(target, tmp_path, write_recipe, capsys):
    template = ("{%- for m in messages %}{%- if m.role == 'tool' %}{{ raise_exception('Tool replies are not "
                "supported') }}{%- endif %}{{ m.role + ': ' + m.content + '\\n' }}{%- endfor %}")
    tool_row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"},
                             {"role": "tool", "tool_call_id": "c", "content": "4"},
                             {"role": "assistant", "content": "four"}]}
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   "{data} line 2: the chat template failed to render this conversation (TemplateError: Tool "
                   "replies are not supported). The template refuses this row's shape, or meets a field it cannot "
                   "handle; fix or remove the row, or set recipe_args.chat_template to a template that accepts it.",
                   rows=(GOOD_ROW, tool_row), chat_template=template)


def test_rows_that_hold_no_tokens(target, tmp_path, write_recipe, capsys):
    template = "{%- for m in messages %}{% generation %}{% endgeneration %}{%- endfor %}"
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   "{data}: every selected row renders to 0 tokens with this tokenizer and chat template, so the "
                   "cache would hold no data. Check the chat template (recipe_args.chat_template) and the tokenizer "
                   "files.", chat_template=template)


def test_prefix_rewriting_template_is_refused_before_writing(target, tmp_path, write_recipe, capsys):
    # Qwen3's stock rule, cut down: reasoning is shown only after the last user message.
    template = (
        "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = "
        "loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' and loop.index0 > ns.last %}{{ '<think>' + (m.reasoning_content or '') + "
        "'</think>' }}{%- endif %}{{ m.content + '<|im_end|>\\n' }}{%- endfor %}"
    )
    two_turns = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                 "reasoning_content": "r"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    run_and_expect(tmp_path, write_recipe, capsys, target,
                   "{data} line 2: rendering its first 2 message(s) alone does not reproduce the start of the whole "
                   "rendered conversation: the chat template rewrites earlier turns from later ones (Qwen3's stock "
                   "template drops the <think> blocks of earlier turns), so NeMo AutoModel refuses to find assistant "
                   "spans from conversation prefixes. Set recipe_args.chat_template to a template that wraps "
                   "assistant turns in {% generation %}...{% endgeneration %}, or to one that renders every turn the "
                   "same whatever follows it.", rows=(GOOD_ROW, two_turns), chat_template=template)
