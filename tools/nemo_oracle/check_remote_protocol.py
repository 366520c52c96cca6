"""Ask a running ``ds-capture serve`` and NeMo AutoModel 0.7.0's own server logic the same questions; print both.

In: the service's URL, the target checkpoint it serves, the chat JSONL and the settings NeMo's trainer would use.
Out (stdout, the last line): one JSON object, per request the endpoint, whether the answer bodies are equal byte
for byte, and where they are not, per tensor key the dtypes, shapes and max |difference|. NeMo's side is its
``TargetModelServer`` request logic (``remote/server.py``, NCCL disabled: the wire path) over an
``HFEagle3TargetModel`` of the model NeMo's recipe loads itself (``NeMoAutoModelForCausalLM`` swapped for
transformers' as in make_eagle3_fixtures.py; fp32, CPU). The questions: ``model_info``, ``input_embeddings``,
``init_nccl``, ``heartbeat``, ``set_vocab_mapping`` (NeMo's own draft vocabulary of the data, then the identity),
and ``generate`` for NeMo's own dataloader batches, a left-padded batch and a batch of random ids:

    python tools/nemo_oracle/check_remote_protocol.py --url http://127.0.0.1:P --target T --data D
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def compare(endpoint: str, ours: bytes, theirs: bytes, wire_body: bool) -> dict:
    result = {"endpoint": endpoint, "equal": ours == theirs}
    if result["equal"] or not wire_body:
        if not result["equal"]:
            result["detail"] = {"ours": ours[:300].decode(errors="replace"),
                                "nemo": theirs[:300].decode(errors="replace")}
        return result
    from nemo_automodel.components.speculative.eagle.remote import wire

    try:
        a = wire.decode(ours)
    except Exception as error:  # noqa: BLE001 - reported
        result["detail"] = {"ours_not_wire": str(error), "ours": ours[:300].decode(errors="replace")}
        return result
    b = wire.decode(theirs)
    detail = {"keys_ours": list(a), "keys_nemo": list(b)}
    for key in b:
        x, y = a.get(key), b[key]
        if x is None or y is None:
            detail[key] = "missing"
            continue
        entry = {"dtype": [str(x.dtype), str(y.dtype)], "shape": [list(x.shape), list(y.shape)]}
        if x.shape == y.shape:
            entry["max_abs_diff"] = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        detail[key] = entry
    result["detail"] = detail
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--seq-length", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=96)
    parser.add_argument("--aux-layer-ids", type=int, nargs="*")
    args = parser.parse_args(argv)
    os.environ["NEMO_EAGLE_ENABLE_NCCL"] = "0"

    import requests
    import torch
    from make_eagle3_fixtures import _install_loader_shim

    _install_loader_shim()
    from nemo_automodel._transformers import NeMoAutoModelForCausalLM
    from nemo_automodel._transformers.auto_tokenizer import NeMoAutoTokenizer
    from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_dataloader, build_eagle3_token_mapping
    from nemo_automodel.components.speculative.eagle.remote import wire
    from nemo_automodel.components.speculative.eagle.remote.server import TargetModelServer
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel

    model = NeMoAutoModelForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32)
    wrapper = HFEagle3TargetModel(model, aux_layer_ids=args.aux_layer_ids)
    nemo = TargetModelServer(wrapper, nccl_port=0, host="127.0.0.1")
    tokenizer = NeMoAutoTokenizer.from_pretrained(args.target)
    loader = build_eagle3_dataloader(data_path=args.data, tokenizer=tokenizer, seq_length=args.seq_length,
                                     batch_size=args.batch_size, shuffle=False)
    specials = [getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                            "unk_token_id")]
    vocab_size = int(model.config.vocab_size)
    ids, mask = build_eagle3_token_mapping(loader, target_vocab_size=vocab_size,
                                           draft_vocab_size=args.draft_vocab_size, special_token_ids=specials)
    session = requests.Session()
    session.trust_env = False

    def ask(endpoint: str, raw: bytes) -> bytes:
        response = session.post(f"{args.url}/{endpoint}", data=raw, timeout=60)
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {response.text}".encode()
        return response.content

    def batch_blob(input_ids, attention_mask, loss_mask) -> bytes:
        return wire.encode_to_bytes({"input_ids": input_ids, "attention_mask": attention_mask,
                                     "loss_mask": loss_mask})

    results = [
        compare("model_info", ask("model_info", b""), nemo.handle_model_info(b""), False),
        compare("input_embeddings", ask("input_embeddings", b""), nemo.handle_input_embeddings(b""), True),
        compare("init_nccl", ask("init_nccl", b'{"nccl_port": 1}'), nemo.handle_init_nccl(b'{"nccl_port": 1}'), False),
        compare("heartbeat", ask("heartbeat", b"{}"), b'{"status": "ok"}', False),
    ]
    generator = torch.Generator().manual_seed(0)
    batches = [batch_blob(b["input_ids"], b["attention_mask"], b["loss_mask"]) for b in list(loader)[:3]]
    # Left padding (NeMo's mask strips nothing here: the forward takes the mask as it comes) and random ids.
    S = args.seq_length
    left = torch.zeros(3, S, dtype=torch.long)
    lengths = [S, S - 7, S // 2]
    for row, length in enumerate(lengths):
        left[row, S - length:] = 1
    random_ids = torch.randint(0, vocab_size, (3, S), generator=generator)
    batches.append(batch_blob(random_ids * left, left, left * torch.randint(0, 2, (3, S), generator=generator)))
    right = left.flip(1)
    batches.append(batch_blob(random_ids * right, right, right))
    identity = (torch.arange(vocab_size), torch.ones(vocab_size, dtype=torch.bool))
    for name, (sel_ids, sel_mask) in (("draft", (ids, mask)), ("identity", identity)):
        mapping = wire.encode_to_bytes({"selected_token_ids": sel_ids, "selected_token_mask": sel_mask})
        results.append(compare(f"set_vocab_mapping[{name}]", ask("set_vocab_mapping", mapping),
                               nemo.handle_set_vocab_mapping(mapping), False))
        for index, blob in enumerate(batches):
            expected, _ = nemo.handle_generate(blob, client_wants_nccl=False)
            results.append(compare(f"generate[{name} {index}]", ask("generate", blob), expected, True))
    print(json.dumps({"all_equal": all(r["equal"] for r in results), "results": results,
                      "draft_vocab_size": int(ids.numel())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
