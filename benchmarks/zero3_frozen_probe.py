"""Probe: does DeepSpeed ZeRO-3 run a FROZEN model (no optimizer, no grads) on CPU / gloo, partitioning every
non-expert parameter while the routed experts (split expert-parallel by ds_capture's own layer) stay out of
the partitioning, and is its forward bitwise the single-process forward?  (issue 26, item 2)

    torchrun --nproc_per_node 2 --master_port 4xxxx benchmarks/zero3_frozen_probe.py [variant ...]

Variants (default: all; ``k3_`` prefix: the same on the tiny release-layout Kimi K3, NeMo's classes):
  plain            deepspeed.initialize(stage 3, no optimizer) on the whole replicated model (experts included)
  plain_offload    the same with offload_param: cpu (ZeRO-Inference's form)
  ep_only          ds_capture's expert-parallel layer alone (ep_size = world), no DeepSpeed: the EP baseline
  ep               experts split expert-parallel, each expert parameter given a one-rank partition group
                   (``ds_zero_partition_process_group``, the attribute 0.19.8's Init._convert_to_deepspeed_param
                   reads, as its AutoEP does with the expert-data-parallel group), then deepspeed.initialize:
                   wrong, the engine's _broadcast_model copies rank 0's experts to every rank first
  ep_init          the same, converted by deepspeed.zero.Init(module=model) before initialize (no broadcast)
  ep_moeflag       as ep, experts also tagged allreduce=False / group_name (DeepSpeed MoE's marker)
  ep_init_offload  ep_init with offload_param: cpu
  ep_stream        experts converted first, then every other parameter one at a time
Prints one JSON line per variant from rank 0.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as tdist


def tiny_model():
    import transformers

    from ds_capture.demo import TINY_CONFIGS

    cfg = transformers.Qwen3MoeConfig(**TINY_CONFIGS["qwen3_moe"], vocab_size=256)
    cfg._experts_implementation = os.environ.get("PROBE_EXPERTS_IMPL", "eager")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def tiny_nemo_k3():
    """The tiny release-layout Kimi K3 (tests/nemo_k3_release.py), NeMo's own classes, fp32, seeded values."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from nemo_k3_release import build_nemo_k3, release_config, tiny_text_config

    model = build_nemo_k3(release_config(tiny_text_config(), quantized=False), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
            p.requires_grad_(False)
    return model


def k3_logits(model, input_ids):
    out = model(input_ids)
    out = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, tuple) else out)
    return out


def ds_config(persist_threshold: int = 0, offload: bool = False):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            # 0: no parameter kept whole ("persistent") because it is small: every one is partitioned
            "stage3_param_persistence_threshold": persist_threshold,
            "stage3_prefetch_bucket_size": 0,
        },
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
    }
    if offload:  # ZeRO-Inference's form: stage 3 with the parameter partitions offloaded to CPU
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": False}
    return cfg


def partition_report(module):
    rows = []
    for name, p in module.named_parameters():
        rows.append(dict(
            name=name,
            ds=hasattr(p, "ds_id"),
            ds_numel=int(getattr(p, "ds_numel", p.numel())),
            local=int(p.ds_tensor.numel()) if getattr(p, "ds_tensor", None) is not None else int(p.numel()),
            data_numel=int(p.data.numel()),
            status=str(getattr(p, "ds_status", None)),
            group_size=(tdist.get_world_size(p.ds_process_group) if hasattr(p, "ds_process_group") else None),
            persist=bool(getattr(p, "ds_persist", False)),
        ))
    return rows


def summarize(rows, is_expert):
    out = {"expert": {"full": 0, "local": 0, "n": 0, "group_sizes": set()},
           "rest": {"full": 0, "local": 0, "n": 0, "group_sizes": set(), "statuses": set()}}
    for r in rows:
        k = "expert" if is_expert(r["name"]) else "rest"
        out[k]["full"] += r["ds_numel"]
        out[k]["local"] += r["local"]
        out[k]["n"] += 1
        out[k]["group_sizes"].add(r["group_size"])
        out[k].setdefault("statuses", set()).add(r["status"])
    for v in out.values():
        for key in list(v):
            if isinstance(v[key], set):
                v[key] = sorted(map(str, v[key]))
    return out


def is_expert_name(name: str) -> bool:
    return ".mlp.experts." in name


def run_variant(variant: str, ref_logits, input_ids, ep_logits=None):
    import deepspeed

    rank, world = tdist.get_rank(), tdist.get_world_size()
    k3 = variant.startswith("k3_")
    model = tiny_nemo_k3() if k3 else tiny_model()
    forward = (lambda m: k3_logits(m, input_ids)) if k3 else (lambda m: m(input_ids=input_ids).logits)
    kind = variant.removeprefix("k3_")
    if kind.startswith("ep") and k3:
        from ds_capture.parallel.grouped_experts import apply_grouped_experts_parallel

        model = apply_grouped_experts_parallel(model, ep_group=tdist.group.WORLD, ep_size=world, ep_rank=rank)
    elif kind.startswith("ep"):
        from ds_capture.parallel.expert_parallel import apply_expert_parallel
        from ds_capture.target.families import get_family

        family = get_family("qwen3_moe")
        model = apply_expert_parallel(model, family, ep_group=tdist.group.WORLD, ep_size=world, ep_rank=rank)
    if kind.startswith("ep"):
        # one single-rank group per rank (new_group is collective: every rank creates all of them)
        own = None
        for r in range(world):
            g = tdist.new_group([r])
            if r == rank:
                own = g
        for name, p in model.named_parameters():
            if is_expert_name(name):
                p.ds_zero_partition_process_group = own
                if kind == "ep_moeflag":  # DeepSpeed MoE's own marker: is_moe_param(p) is then True
                    p.allreduce, p.group_name = False, f"ep_size_{world}"
        if kind == "ep_moeflag":
            from deepspeed.utils import groups

            groups._create_expert_and_data_parallel(world)  # names the groups "ep_size_<world>"
        if kind.startswith("ep_init"):
            # convert the parameters ourselves, before deepspeed.initialize: the engine then sees a
            # zero-init model and skips its _broadcast_model (which would overwrite every rank's experts
            # with rank 0's); Init broadcasts each parameter inside its own partition group only
            deepspeed.zero.Init(module=model, config_dict_or_path=ds_config(offload=variant.endswith("offload")))
        if kind == "ep_stream":
            # one parameter at a time, as a loader would (load it whole, convert it, drop the full copy): the
            # experts first (Init on one experts module), then every other parameter through the bound
            # convert_to_zero_parameters of a converted one
            first = next(m for n, m in model.named_modules() if n.endswith(".mlp.experts"))
            deepspeed.zero.Init(module=first, config_dict_or_path=ds_config())
            convert = next(p for p in model.parameters() if hasattr(p, "ds_id")).convert_to_zero_parameters
            for _, p in model.named_parameters():
                if not hasattr(p, "ds_id"):
                    convert(param_list=[p])
    result = {"variant": variant, "world": world,
              "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    if kind == "ep_only":  # the expert-parallel layer alone, no DeepSpeed: the baseline for "ep"
        with torch.no_grad():
            logits = forward(model)
        result["max_abs_diff_vs_single"] = (logits - ref_logits).abs().max().item()
        result["bitwise_equal"] = bool(torch.equal(logits, ref_logits))
        result["logits"] = logits
        return result
    t0 = time.time()
    try:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(offload=variant.endswith("offload")))
    except Exception as exc:  # noqa: BLE001
        result["initialize_error"] = f"{type(exc).__name__}: {exc}"
        result["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
        return result
    result["initialize_s"] = round(time.time() - t0, 2)
    result["engine_type"] = type(engine).__name__
    result["optimizer"] = type(engine.optimizer).__name__ if engine.optimizer is not None else None
    rows = partition_report(engine.module)
    result["partition"] = summarize(rows, is_expert_name)
    # the transient: at every module's forward (after DeepSpeed's own pre-hook gathered its parameters), how many
    # elements of the rest are materialised on this rank, all modules together
    rest_params = [(n, p) for n, p in engine.module.named_parameters() if not is_expert_name(n)]
    peak = {"numel": 0, "module": None, "held": []}

    def watch(module, _args):
        held = sum(p.data.numel() for _, p in rest_params)
        if held > peak["numel"]:
            peak["numel"], peak["module"] = held, type(module).__name__
            peak["held"] = [n for n, p in rest_params if p.data.numel()]

    handles = [m.register_forward_pre_hook(watch) for m in engine.module.modules()]
    try:
        with torch.no_grad():
            logits = forward(engine)
        diff = (logits - ref_logits).abs().max().item()
        result["max_abs_diff_vs_single"] = diff
        result["bitwise_equal"] = bool(torch.equal(logits, ref_logits))
        if ep_logits is not None and kind.startswith("ep"):
            # the exactness that is DeepSpeed's to keep: equal to the same expert-parallel layer without it
            result["max_abs_diff_vs_ep_only"] = (logits - ep_logits).abs().max().item()
            result["bitwise_equal_vs_ep_only"] = bool(torch.equal(logits, ep_logits))
        # the same on every rank?
        gathered = [torch.empty_like(logits) for _ in range(world)]
        tdist.all_gather(gathered, logits.contiguous())
        result["ranks_identical"] = all(torch.equal(gathered[0], g) for g in gathered)
        # after the forward, the rest is released again
        after = summarize(partition_report(engine.module), is_expert_name)
        result["rest_status_after_forward"] = after["rest"]["statuses"]
        result["rest_local_after_forward_data_numel"] = sum(
            r["data_numel"] for r in partition_report(engine.module) if not is_expert_name(r["name"]))
        # a second forward (the coordinator's trace is recorded on the first)
        with torch.no_grad():
            logits2 = forward(engine)
        result["second_forward_equals_first"] = bool(torch.equal(logits2, logits))
        with torch.no_grad():  # the unwrapped module, with the hooks DeepSpeedZeRoOffload registered on it
            logits3 = forward(engine.module)
        result["engine_module_forward_equals_engine"] = bool(torch.equal(logits3, logits))
        for h in handles:
            h.remove()
        result["max_rest_numel_materialised_in_forward"] = peak["numel"]
        result["at_module"] = peak["module"]
        result["held_at_peak"] = peak["held"]
        result["largest_rest_module_numel"] = max(
            sum(getattr(p, "ds_numel", p.numel()) for n, p in m.named_parameters(recurse=False)
                if not is_expert_name(f"{mn}.{n}")) for mn, m in engine.module.named_modules())
    except Exception as exc:  # noqa: BLE001
        result["forward_error"] = f"{type(exc).__name__}: {exc}"
        result["traceback_tail"] = traceback.format_exc().splitlines()[-8:]
    return result


def main():
    import deepspeed
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    rank = tdist.get_rank()
    variants = sys.argv[1:] or ["plain", "plain_offload", "ep", "ep_init", "ep_moeflag", "ep_init_offload",
                                "ep_stream", "k3_plain", "k3_ep", "k3_ep_init", "k3_ep_init_offload", "k3_ep_stream"]
    for family in ("qwen", "k3"):
        mine = [v for v in variants if v.startswith("k3_") == (family == "k3")]
        if not mine:
            continue
        torch.manual_seed(1)
        if family == "k3":
            input_ids = torch.randint(0, 128, (1, 16))
            with torch.no_grad():
                ref_logits = k3_logits(tiny_nemo_k3(), input_ids)
        else:
            input_ids = torch.randint(0, 256, (1, 24))
            with torch.no_grad():
                ref_logits = tiny_model()(input_ids=input_ids).logits
        ep_logits = None
        if any(v.removeprefix("k3_").startswith("ep") for v in mine):
            prefix = "k3_" if family == "k3" else ""
            ep_logits = run_variant(prefix + "ep_only", ref_logits, input_ids)["logits"]
        for v in mine:
            res = run_variant(v, ref_logits, input_ids, ep_logits)
            res.pop("logits", None)
            res.update(deepspeed=deepspeed.__version__, torch=torch.__version__,
                       transformers=transformers.__version__)
            if rank == 0:
                print("PROBE " + json.dumps(res), flush=True)
            tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
