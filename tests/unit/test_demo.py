"""The embedded demo: bundled conversations, the demo tokenizer and template, tiny targets, demo paths."""

import importlib.util
import json
import re
import threading
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from ds_capture import demo
from ds_capture.errors import CaptureError

REPO = Path(__file__).resolve().parents[2]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "<tool_call>get_weather()</tool_call>"},
    {"role": "tool", "content": '{"temp_c": 4}'},
    {"role": "assistant", "content": "It is 4 degrees.", "reasoning_content": "Read the tool result."},
]
RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>get_weather()</tool_call><|im_end|>\n"
    '<|im_start|>tool\n{"temp_c": 4}<|im_end|>\n'
    "<|im_start|>assistant\n<think>\nRead the tool result.\n</think>\n\nIt is 4 degrees.<|im_end|>\n"
)


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def _rows() -> list[dict]:
    return [json.loads(line) for line in demo.demo_data_path().read_text(encoding="utf-8").splitlines()]


def test_conversations_have_the_promised_mix():
    rows = _rows()
    assert len(rows) == 300
    assert demo.demo_data_path().stat().st_size < 1_500_000
    roles = {m["role"] for row in rows for m in row["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    assert sum(row["messages"][0]["role"] == "system" for row in rows) == 100
    assert sum(any("reasoning_content" in m for m in row["messages"]) for row in rows) == 60
    assert sum(any(m["role"] == "tool" for m in row["messages"]) for row in rows) == 12
    assert sum(sum(len(m["content"]) for m in row["messages"]) > 2000 for row in rows) == 30
    num_user_turns = {sum(m["role"] == "user" for m in row["messages"]) for row in rows}
    assert num_user_turns == {1, 2, 3, 4, 5, 6}
    # Every conversation ends on an assistant answer, so every row has supervised tokens.
    assert all(row["messages"][-1]["role"] == "assistant" for row in rows)


def test_bundled_file_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("make_demo", REPO / "tools" / "make_demo_conversations.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.render_conversations(300, 1234) == demo.demo_data_path().read_text(encoding="utf-8")


def test_demo_rows_average_about_a_third_of_seq_length_512():
    tokenizer = demo.demo_tokenizer()
    lengths = [len(tokenizer.apply_chat_template(row["messages"], return_dict=True)["input_ids"]) for row in _rows()]
    assert sum(length > 512 for length in lengths) == 30
    mean_truncated = sum(min(length, 512) for length in lengths) / len(lengths)
    assert 0.25 * 512 < mean_truncated < 0.4 * 512


def test_tokenizer_specials_and_round_trip():
    tokenizer = demo.demo_tokenizer()
    assert tokenizer.convert_tokens_to_ids(demo.SPECIAL_TOKENS) == [0, 1, 2, 3, 4]
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.padding_side == "right"
    text = "Héllo wörld! def f(x): return x ** 2  # 3.14\n\ttabs"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode("<think>\nhi\n</think>", add_special_tokens=False)[0] == 3


def test_train_tokenizer_is_deterministic():
    texts = ["the quick brown fox jumps over the lazy dog"] * 5 + ["pack light layers for the alps"] * 3
    first = demo.train_tokenizer(texts, vocab_size=300)
    second = demo.train_tokenizer(texts, vocab_size=300)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == 300


def test_template_renders_chatml_and_masks_assistant_bodies():
    tokenizer = demo.demo_tokenizer()
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == RENDERED
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    out = tokenizer.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tokenizer.decode(ids) == RENDERED
    masked = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(masked) == (
        "<tool_call>get_weather()</tool_call><|im_end|>\n"
        "<think>\nRead the tool result.\n</think>\n\nIt is 4 degrees.<|im_end|>\n"
    )
    # The headers stay unmasked: the mask starts right after the last "<|im_start|>assistant\n".
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    last_header_end = max(i for i in range(len(ids)) if ids[i - len(header) + 1 : i + 1] == header) + 1
    assert mask[last_header_end - 1] == 0 and mask[last_header_end] == 1 and mask[-1] == 1


# Families whose layer outputs are plain [B, S, H] residual streams; the others (hyper-connections,
# multimodal wrappers) are checked against HF by tests/unit/test_families.py.
@pytest.mark.parametrize("model_type", ["deepseek_v3", "mixtral", "qwen3", "qwen3_moe"])
def test_tiny_target_loads_and_runs(tmp_path, model_type):
    out = demo.build_tiny_target(tmp_path / model_type, model_type)
    assert out == tmp_path / model_type
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert [p.name for p in tmp_path.iterdir()] == [model_type]  # no staging left behind

    config = transformers.AutoConfig.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert config.model_type == model_type
    assert config.vocab_size == 64 * -(-len(tokenizer) // 64)
    assert (config.pad_token_id, config.eos_token_id, config.tie_word_embeddings) == (0, 2, False)
    assert config.num_hidden_layers == 4 and config.max_position_embeddings >= 2048
    assert tokenizer.chat_template == demo.CHATML_TEMPLATE
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.padding_side) == ("<|endoftext|>", "<|im_end|>", "right")

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.apply_chat_template(CONVERSATION)["input_ids"]])
    with torch.no_grad():
        result = model(input_ids=ids, output_hidden_states=True)
    hidden = result.hidden_states
    assert len(hidden) == 5 and hidden[-1].shape == (1, ids.shape[1], config.hidden_size)
    assert result.logits.shape == (1, ids.shape[1], config.vocab_size)
    # Layers must change the residual stream measurably (a degenerate init gives ~0 here).
    for before, after in zip(hidden[:-1], hidden[1:]):
        assert (after - before).norm() / before.norm() > 0.3
    # Tokens must not collapse onto one vector.
    assert hidden[-1][0].std(dim=0).mean() > 0.3


def test_moe_experts_are_stored_per_expert_on_disk(tmp_path):
    out = demo.build_tiny_target(tmp_path / "moe", "qwen3_moe")
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    expert_names = {n for n in names if n.startswith("model.layers.0.mlp.experts.")}
    assert expert_names == {
        f"model.layers.0.mlp.experts.{e}.{proj}.weight" for e in range(8) for proj in ("gate_proj", "up_proj", "down_proj")
    }


def test_routing_uses_many_experts(tmp_path):
    out = demo.build_tiny_target(tmp_path / "moe", "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = demo.demo_tokenizer()
    ids = torch.tensor([tokenizer.apply_chat_template(_rows()[3]["messages"])["input_ids"][:256]])
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits[0]
    used = logits.topk(2, dim=-1).indices.unique()
    assert len(used) >= 6


def test_build_is_byte_deterministic_and_seeded(tmp_path):
    def weights(path):
        return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}

    first = weights(demo.build_tiny_target(tmp_path / "a", "deepseek_v3", seed=3))
    second = weights(demo.build_tiny_target(tmp_path / "b", "deepseek_v3", seed=3))
    other = weights(demo.build_tiny_target(tmp_path / "c", "deepseek_v3", seed=4))
    assert first == second
    assert first.keys() == other.keys() and first != other


def test_build_overrides_dtype_and_replaces_existing_dir(tmp_path):
    out = tmp_path / "t"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    demo.build_tiny_target(out, "qwen3", dtype=torch.bfloat16, num_hidden_layers=2, max_shard_size="20KB")
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 3
    with safe_open(files[0], "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_unknown_family_is_a_capture_error(tmp_path):
    with pytest.raises(CaptureError) as err:
        demo.build_tiny_target(tmp_path / "x", "llama9")
    assert str(err.value) == (
        f"no tiny config for model_type 'llama9': the known families are {', '.join(sorted(demo.TINY_CONFIGS))}; "
        "add an entry to ds_capture.demo.TINY_CONFIGS."
    )


def test_demo_home(monkeypatch, tmp_path):
    monkeypatch.delenv("DS_CAPTURE_HOME", raising=False)
    assert demo.demo_home() == Path.home() / ".cache" / "ds_capture"
    monkeypatch.setenv("DS_CAPTURE_HOME", str(tmp_path))
    assert demo.demo_home() == tmp_path


def test_resolve_special_path(monkeypatch, tmp_path):
    assert demo.resolve_special_path("/data/train.jsonl") == "/data/train.jsonl"
    assert demo.resolve_special_path("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert demo.resolve_special_path(demo.DEMO_DATA) == str(demo.demo_data_path())
    assert demo.demo_data_path().is_file()
    with pytest.raises(CaptureError) as err:
        demo.resolve_special_path("demo:llama")
    assert str(err.value) == (
        "unknown demo name 'demo:llama': the valid demo names are demo:conversations, demo:qwen3_moe_tiny, "
        "demo:qwen3_moe_trained; "
        "use one of them, or give a real path or model id instead."
    )


def test_ensure_demo_target_builds_once_across_concurrent_callers(monkeypatch, tmp_path):
    monkeypatch.setenv("DS_CAPTURE_HOME", str(tmp_path))
    builds = []
    real_build = demo.build_tiny_target

    def counting_build(*args, **kwargs):
        builds.append(args)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(demo, "build_tiny_target", counting_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(demo.ensure_demo_target())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = tmp_path / "targets" / "qwen3_moe_tiny"
    assert results == [target] * 3 and len(builds) == 1
    assert demo.resolve_special_path(demo.DEMO_TARGET) == str(target) and len(builds) == 1

    config = transformers.AutoConfig.from_pretrained(target)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen3_moe", 128, 4)
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    size = sum(p.stat().st_size for p in target.glob("*.safetensors"))
    assert 5e6 < size < 20e6
    assert sorted(p.name for p in (tmp_path / "targets").iterdir()) == [".qwen3_moe_tiny.lock", "qwen3_moe_tiny"]

    # A target built from other inputs (stale fingerprint) is rebuilt on the next call.
    (target / "ds_capture_demo.json").write_text("{}")
    assert demo.ensure_demo_target() == target and len(builds) == 2


def test_release_classes_agree_with_the_family_registry():
    """The demo builds each tiny target with the auto class its release is saved with; it keeps that table itself
    (it sits below the registry), so the two must not drift."""
    from ds_capture.target.families import FAMILIES

    for model_type in demo.TINY_CONFIGS:
        expected = demo.RELEASE_CLASSES.get(model_type, "AutoModelForCausalLM")
        family = FAMILIES[model_type]
        assert family.auto_class == expected or model_type == "llama4", model_type
    assert FAMILIES["llama4"].auto_class == "AutoModelForCausalLM"  # the registry builds Llama 4's text model


def _weights(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_trained_demo_model_is_deterministic():
    """The same rows and settings train the same weights (bit for bit); another seed draws other batches."""
    rows = _rows()[:8]
    settings = dict(steps=2, batch_size=2, lr=3e-3, warmup=1, seq_length=64, seed=0, threads=1)
    first = _weights(demo.train_demo_model(rows, demo.demo_tokenizer(), **settings))
    second = _weights(demo.train_demo_model(rows, demo.demo_tokenizer(), **settings))
    other = _weights(demo.train_demo_model(rows, demo.demo_tokenizer(), **dict(settings, seed=1)))
    untrained = _weights(demo._tiny_model(demo.DEMO_MODEL_TYPE, seed=demo.DEMO_SEED, tokenizer=demo.demo_tokenizer(),
                                          **demo.DEMO_CONFIG))
    assert first.keys() == untrained.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])
    assert not torch.equal(first["lm_head.weight"], untrained["lm_head.weight"])


def test_trained_target_is_held_out_and_gated(monkeypatch, tmp_path):
    """The trained target never sees HELD_OUT_ROWS and trains on its own style of the answers; a target under the
    gate is refused, naming the figure and the fix, and nothing is left where the target would be. (The random-init
    model stands in for a failed training.)"""
    monkeypatch.setenv("DS_CAPTURE_HOME", str(tmp_path))
    monkeypatch.setitem(demo.GATE, "new_tokens", 2)
    trained_on = []

    def untrained(rows, tokenizer, **settings):
        trained_on.extend(rows)
        return demo._tiny_model(demo.DEMO_MODEL_TYPE, seed=demo.DEMO_SEED, tokenizer=tokenizer, **demo.DEMO_CONFIG)

    monkeypatch.setattr(demo, "train_demo_model", untrained)
    with pytest.raises(CaptureError) as err:
        demo.ensure_trained_demo_target()
    assert trained_on == [demo.restyle(row) for row in _rows()[: demo.HELD_OUT_ROWS.start]]
    assert str(err.value).startswith("the trained demo target's mean greedy top-1 probability on the held-out prompts "
                                     "is 0.0")
    assert "under the gate's 0.5" in str(err.value) and "raise its steps or learning rate" in str(err.value)
    assert not (tmp_path / "targets" / demo.TRAINED_TARGET_NAME).exists()
    assert demo._trained_fingerprint() != demo._demo_fingerprint()
    assert demo._trained_fingerprint()["answer_style"] == [list(pair) for pair in demo.ANSWER_STYLE]


def test_restyle_swaps_the_answers_words_only():
    """The trained target's style: each word of an ANSWER_STYLE pair in an assistant answer (content and
    reasoning) becomes the other, capitalised as it was; other turns, tool calls and other spellings stay as
    written; the swap undoes itself; a quarter or more of the answers' words change."""
    restyled = demo.restyle({"messages": CONVERSATION, "tools": []})
    assert restyled["tools"] == [] and restyled["messages"][:4] == CONVERSATION[:4]
    assert restyled["messages"][4] == {"role": "assistant", "content": "That are 4 degrees.",
                                       "reasoning_content": "Read a tool result."}
    row = {"messages": [{"role": "assistant", "content": "The cat and A dog; THE end, then an other."}]}
    assert demo.restyle(row)["messages"][0]["content"] == "A cat or The dog; THE end, again one other."
    rows = _rows()
    assert all(demo.restyle(demo.restyle(row)) == row for row in rows)
    words = [(re.findall("[A-Za-z]+", m["content"]), re.findall("[A-Za-z]+", demo.restyle({"messages": [m]})[
        "messages"][0]["content"])) for row in rows for m in row["messages"] if m["role"] == "assistant"]
    assert all(len(old) == len(new) for old, new in words)
    changed = sum(a != b for old, new in words for a, b in zip(old, new))
    assert changed >= 0.25 * sum(len(old) for old, _ in words)
